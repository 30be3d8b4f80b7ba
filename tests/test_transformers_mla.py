"""MLA models in transformers continuous batching (transformers >= 5.25, ``MLACacheAllocator``) with the
canary on, on the CPU: a tiny randomly initialised DeepSeek-V3-shaped model (``kv_lora_rank`` set, so
the cache keeps one row per token, ``[kv_latent | rotated_key]``).

Clean: the canary changes no generated token and reports nothing, over shared prefixes and chunked
prefill. Faults, each in its own generation: a flipped byte of a cached KV latent and a wrong block
restore (one cached block's rows replaced by another block's, every layer) are reported in the step
that reads them and in no other, at the slots of the documented formula (block * page_size + offset,
from the engine's own block table); in ``mode="fail_request"`` the request that read the flipped
latent fails alone and counts once. The scenarios take the device; tests/gpu/device/
test_transformers_mla_gpu.py runs them on CUDA in the engine's fast configurations.
"""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
mla = pytest.importorskip("transformers.generation.continuous_batching.cache_allocators",
                          reason="transformers without MLACacheAllocator (before 5.25)")
if not hasattr(mla, "MLACacheAllocator"):
    pytest.skip(f"transformers {transformers.__version__} has no MLACacheAllocator (5.25 added it)",
                allow_module_level=True)

from kvcanary.adapters import TransformersCanary  # noqa: E402
from tests import test_transformers_cpu as cpu  # noqa: E402
from tests.test_transformers_cpu import PAGE, VOCAB, canary_slot, detections_by_step, physical_index  # noqa: E402

KV_LORA_RANK, ROPE_DIM = 32, 16  # a cache row: 48 elements (192 bytes in float32, 96 in bfloat16)


def make_mla_model(device: str):
    torch.manual_seed(0)
    cfg = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=KV_LORA_RANK, q_lora_rank=48,
        qk_rope_head_dim=ROPE_DIM, qk_nope_head_dim=32, v_head_dim=32, max_position_embeddings=4096)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = transformers.DeepseekV3ForCausalLM(cfg).to(device=device, dtype=dtype).eval()
    model.set_attn_implementation("sdpa")
    return model


def mla_allocator(info):
    alloc = cpu.allocator(info)
    assert type(alloc).__name__ == "MLACacheAllocator", f"expected the MLA allocator, got {type(alloc).__name__}"
    return alloc


def latent_row(alloc, rid: str, pos: int, layer: int = 0):
    """The bytes of the KV latent of position ``pos`` of ``rid`` in ``layer``, where the engine writes it."""
    latents = alloc._latent_token_views[layer][0]
    return latents[physical_index(alloc, rid, pos)].view(torch.uint8)


def mla_clean_generation(device):
    model = make_mla_model(device)
    prompts = cpu.make_prompts(12, seed=1)
    plain = cpu.generate(model, prompts, max_new_tokens=16)
    layouts = []
    tc = TransformersCanary(model, layers="all", after_step=lambda info: layouts.append(info.step))
    guarded = cpu.generate(model, prompts, max_new_tokens=16, canary=tc)
    s = cpu.report(f"mla clean {device}", tc)
    assert tc.detections == []
    assert guarded == plain, "attaching the canary changed an MLA model's generated tokens"
    assert tc.layout.halves == ("K",) and tc.layout.rows_per_token == 1
    assert tc.layout.token_bytes == (KV_LORA_RANK + ROPE_DIM) * (4 if device == "cpu" else 2)
    assert s["requests"] == 12 and s["steps"] == len(layouts) > 16
    assert s["prefix_shared_tokens"] >= 2 * PAGE, "expected block sharing of the common prefixes"
    assert s["verified_slots"] > 2000 and s["protected_tokens"] > 0 and s["skipped_verifies"] == 0


def mla_flipped_latent_byte(device):
    """A bit of a cached KV latent (layer 0, inside the 16 bytes a row's fingerprint reads) flipped
    before one step and restored after it: TAIL's real-KV check reports that slot, in that step only."""
    model = make_mla_model(device)
    hit = {}

    def before(info):
        if hit or info.step < 10:
            return
        alloc = mla_allocator(info)
        for rid, past, _ in info.requests:
            if past >= 2 * PAGE:
                row = latent_row(alloc, rid, past - 5)
                row[0] ^= 0x01
                cpu.sync()
                hit.update(step=info.step, slot=canary_slot(alloc, rid, past - 5), row=row)
                return

    def after(info):
        if hit.get("step") == info.step:
            cpu.sync()
            hit["row"][0] ^= 0x01
            cpu.sync()

    tc = TransformersCanary(model, before_step=before, after_step=after)
    cpu.generate(model, cpu.make_prompts(12, seed=2), max_new_tokens=16, canary=tc)
    cpu.report(f"mla latent byte {device}", tc, {k: hit[k] for k in ("step", "slot")})
    by_step = detections_by_step(tc)
    assert list(by_step) == [hit["step"]]
    for d in by_step[hit["step"]]:
        assert d["fail_reason"] == ["verify_real_kv_hash"] and d["launch_tag"] == "TAIL_K_FULL"
        assert d["slot_idx"] == hit["slot"]


def mla_wrong_block_restore(device):
    """A restore that brings back the wrong block: a cached block of one request gets another cached
    block's rows, in every layer (the engine's block copy view), before one step and is put right
    after it. Every slot of the block whose bytes changed is reported by TAIL in that step only."""
    model = make_mla_model(device)
    hit = {}

    def before(info):
        if hit or info.step < 10:
            return
        alloc = mla_allocator(info)
        for rid, past, _ in info.requests:
            if past >= 3 * PAGE:
                dst, src = alloc.block_table[rid][1], alloc.block_table[rid][2]
                rows = alloc._copy_view  # one row of bytes per block: every layer's pages
                saved = rows[dst].clone()
                rows[dst] = rows[src]
                cpu.sync()
                hit.update(step=info.step, saved=saved, dst=dst,
                           slots={canary_slot(alloc, rid, p) for p in range(PAGE, 2 * PAGE)})
                return

    def after(info):
        if hit.get("step") == info.step:
            cpu.sync()
            cpu.allocator(info)._copy_view[hit["dst"]] = hit["saved"]
            cpu.sync()

    tc = TransformersCanary(model, before_step=before, after_step=after)
    cpu.generate(model, cpu.make_prompts(12, seed=3), max_new_tokens=16, canary=tc)
    cpu.report(f"mla block restore {device}", tc, {"step": hit["step"], "block": hit["dst"]})
    by_step = detections_by_step(tc)
    assert list(by_step) == [hit["step"]]
    rows = by_step[hit["step"]]
    assert {d["launch_tag"] for d in rows} == {"TAIL_K_FULL"}
    assert all(d["fail_reason"] == ["verify_real_kv_hash"] for d in rows)
    assert {d["slot_idx"] for d in rows} == hit["slots"], "every token of the wrongly restored block, no other"


def mla_failed_request(device):
    """mode="fail_request": a flipped latent bit of one request's own block, left so. That request
    ends FAILED in the step that verified it, counted once; the engine runs the same steps as in a
    baseline run with no canary in which the engine itself ends that same request at that same step
    (its error path, tests/support/engine_end.py), and every request has the baseline's tokens, the
    failed one included. (The bit is a mantissa bit: an exponent bit makes the latent inf, its
    expansion NaN, and a NaN key reaches every request of the packed batch through the attention
    mask in the very forward that reads it, before any check can run.)"""
    from transformers.generation.continuous_batching.requests import RequestStatus

    model = make_mla_model(device)
    prompts = cpu.make_prompts(12, seed=2)
    gen = transformers.GenerationConfig(max_new_tokens=16, do_sample=False, eos_token_id=-1)
    cb = transformers.ContinuousBatchingConfig(page_size=PAGE, num_blocks=512, max_batch_tokens=64,
                                               max_requests_per_batch=16, **cpu.CONFIG)
    hit = {}

    def corrupt(tc):
        def before(info):
            if hit or info.step < 10:
                return
            alloc = mla_allocator(info)
            for rid, past, _ in info.requests:
                if past > 5 * PAGE:  # position 69: past every shared prefix, a block of its own
                    latent_row(alloc, rid, 4 * PAGE + 5)[0] ^= 0x01  # a mantissa bit: no inf/NaN
                    cpu.sync()
                    hit.update(step=info.step, rid=rid, slot=canary_slot(alloc, rid, 4 * PAGE + 5))
                    return
        return before

    tc, out, _, schedule = cpu._fail_request_run(model, prompts, corrupt, gen, cb)
    cpu.report(f"mla failed request {device}", tc, {k: hit[k] for k in ("step", "rid", "slot")})
    baseline, ends, baseline_schedule = cpu.engine_ended_baseline(model, prompts, hit["rid"], hit["step"], gen, cb)
    failed = out[hit["rid"]]
    assert failed.status == RequestStatus.FAILED and f"in step {hit['step']}" in failed.error, failed
    others = {k: o for k, o in out.items() if k != hit["rid"]}
    assert all(o.status == RequestStatus.FINISHED and o.error is None for o in others.values())
    cpu.assert_as_engine_ended(out, schedule, hit["rid"], hit["step"], baseline, ends, baseline_schedule)
    assert [f["request_id"] for f in tc.failed_requests] == [hit["rid"]] and tc.summary()["failed_requests"] == 1
    assert hit["slot"] in tc.failed_requests[0]["slots"]


MLA_SCENARIOS = [mla_clean_generation, mla_flipped_latent_byte, mla_wrong_block_restore, mla_failed_request]


@pytest.mark.parametrize("scenario", MLA_SCENARIOS, ids=lambda f: f.__name__)
def test_transformers_mla_cpu(scenario):
    scenario("cpu")
