"""kvcanary as a vLLM KV connector, against vLLM's own code (tests/support/vllm_engine.py): the flag
loads it through KVConnectorFactory in both roles; vLLM's Scheduler schedules and updates, vLLM's
worker glue calls the hooks around a stand-in forward that writes real K/V bytes; detections reach
vLLM's kv_load_failure_policy. CPU tensors on kvcanary's host backend here; the same scenario with
CUDA tensors and a graph-replayed forward runs in the GPU tier (``test_gpu_*``).
Skipped where vLLM is not installed (the README's test command installs it: tests/vllm-cpu.txt)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("torch")
pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM is not installed (pip install --no-deps -r "
                                                           "tests/vllm-cpu.txt)")

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402

import kvcanary as kc  # noqa: E402
from kvcanary.adapters.vllm_connector import KvCanaryConnector, connector_settings  # noqa: E402
from kvcanary.adapters.vllm_steps import SchedulerNotes  # noqa: E402
from tests.conftest import gpu_unavailable_reason  # noqa: E402
from tests.support.vllm_engine import Engine, tiny_model  # noqa: E402

A = list(range(1, 41))        # 40 tokens: 2 full blocks and a partial one; chunked at 32 tokens a step
B = list(range(500, 523))     # 23 tokens


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("tiny-llama"))


def engine(model, **kw) -> Engine:
    return Engine(model, **kw)


def serve(model, prompts: dict, fault=None, **kw) -> Engine:
    e = engine(model, **kw)
    for rid, (prompt, n) in prompts.items():
        e.add(rid, prompt, n)
    e.run(fault=fault)
    return e


@pytest.fixture(scope="module")
def clean(model):
    """A and B without any connector: vLLM alone (the tokens every canary run must reproduce)."""
    return serve(model, {"a": (A, 12), "b": (B, 12)}, connector=None).outputs


def flip_at(step: int, request: str, block_index: int):
    """A fault: at ``step``, before the forward, one bit of a cached token of ``request``'s block."""
    def fault(e, k):
        if k == step:
            e.flipped = e.blocks(request)[block_index]
            e.flip(e.flipped, offset=3)
    return fault


def test_the_flag_loads_the_connector_through_vllms_factory_in_both_roles(model):
    e = engine(model)
    assert KVConnectorFactory.get_connector_class(e.config.kv_transfer_config) is KvCanaryConnector
    assert isinstance(e.scheduler.connector, KvCanaryConnector) and e.scheduler.connector.role == KVConnectorRole.SCHEDULER
    assert isinstance(e.worker, KvCanaryConnector) and e.worker.role == KVConnectorRole.WORKER
    assert e.worker.canary is not None and e.worker.config.mode == "fail_request"  # defaults: fail closed
    assert e.worker.verdicts == "step"   # auto, without async scheduling: the step that read bad KV emits nothing
    assert e.worker.requires_kv_delivery is False
    assert e.scheduler.connector.get_num_new_matched_tokens(None, 0) == (0, False)


def test_clean_runs_report_nothing_and_change_nothing(model, clean):
    # chunked prefill (A is 40 tokens, a step takes 32), decode, a prefix-cache hit (c shares A's first two
    # blocks), preemption and block reuse (a pool of 14 blocks for 5 requests that need 4 each)
    prompts = {"a": (A, 12), "b": (B, 12), "c": (A[:32] + [900, 901, 902], 10), "d": (list(range(40, 80)), 20),
               "e": (list(range(80, 110)), 20)}
    base = serve(model, prompts, connector=None, num_blocks=14)
    e = serve(model, prompts, num_blocks=14)
    assert e.preempted > 0 and e.new_computed["c"] > 0          # the scenario did preempt and hit the cache
    assert e.outputs == base.outputs and set(e.finished.values()) == {"length"}
    c = e.worker.canary
    c.flush()
    stats = c.stats()
    assert stats["violations"] == 0 and stats["verified_slots"] > 1000, stats
    assert not any(e.invalid) and e.worker.failed == []
    c.health_check()


def test_a_flipped_byte_fails_only_the_request_that_read_it(model, clean):
    e = serve(model, {"a": (A, 12), "b": (B, 12)}, fault=flip_at(4, "a", 1))
    assert e.finished == {"a": "error", "b": "length"}
    assert e.outputs["b"] == clean["b"]                           # B never noticed
    assert e.outputs["a"] == clean["a"][:len(e.outputs["a"])]     # A's tokens up to the fault are the clean ones
    assert len(e.outputs["a"]) == 3                               # and none from the step that read the flip
    assert sum(bool(s) for s in e.invalid) == 1 and e.flipped in set().union(*e.invalid)
    (f,) = e.worker.failed
    assert f["request_id"] == "a" and f["blocks"] == [e.flipped] and "verify_real_kv_hash" in f["reasons"]
    assert e.flipped not in e.cached_blocks()                      # evicted from vLLM's prefix cache
    # the same prompt again: only the block before the bad one is a cache hit; the rest is recomputed
    e.add("a2", A, 12)
    e.run()
    assert e.new_computed["a2"] == 16 and e.outputs["a2"] == clean["a"] and e.finished["a2"] == "length"
    assert len(e.worker.failed) == 1


def test_recompute_policy_heals_the_request(model, clean):
    e = serve(model, {"a": (A, 12), "b": (B, 12)}, fault=flip_at(4, "a", 1), policy="recompute")
    assert e.finished == {"a": "length", "b": "length"}
    assert e.outputs == clean                                     # A recomputed its bad block: the clean tokens
    assert len(e.worker.failed) == 1


def test_verdicts_next_lets_exactly_one_token_escape(model, clean):
    e = serve(model, {"a": (A, 12), "b": (B, 12)}, fault=flip_at(4, "a", 1), extra={"verdicts": "next"})
    assert e.finished == {"a": "error", "b": "length"} and e.outputs["b"] == clean["b"]
    assert len(e.outputs["a"]) == 4   # one more than with "step": the token of the step that read the flip,
    assert e.outputs["a"][:3] == clean["a"][:3] and e.outputs["a"][3] != clean["a"][3]  # computed from it
    assert [f["request_id"] for f in e.worker.failed] == ["a"]   # once, though it read the flip twice


@pytest.mark.parametrize("verdicts", ["auto", "step"])
def test_async_scheduling(model, clean, verdicts):
    # vLLM's default: step k + 1 is scheduled before step k's token reaches the host, so a decode token
    # is stamped as unknown (-1) and the forward takes it from the device; the tokens stay vLLM's own
    prompts = {"a": (A, 12), "b": (B, 12)}
    base = serve(model, prompts, connector=None, async_scheduling=True)
    assert base.outputs == clean
    e = serve(model, prompts, async_scheduling=True, extra={"verdicts": verdicts})
    assert e.worker.verdicts == ("next" if verdicts == "auto" else "step")
    assert e.outputs == clean and not e.worker.failed
    e.worker.canary.flush()
    assert e.worker.canary.stats()["violations"] == 0
    e = serve(model, prompts, async_scheduling=True, fault=flip_at(4, "a", 1), extra={"verdicts": verdicts})
    assert e.finished == {"a": "error", "b": "length"} and e.outputs["b"] == clean["b"]
    escaped = 1 if verdicts == "auto" else 0     # "next": the token of the step that read the flip
    assert e.outputs["a"][:3] == clean["a"][:3] and len(e.outputs["a"]) == 3 + escaped
    assert [f["request_id"] for f in e.worker.failed] == ["a"] and e.flipped not in e.cached_blocks()


def test_recompute_under_async_scheduling_is_vllms_limit(model, clean):
    """vLLM 0.34.0 cannot heal a running request under async scheduling: Scheduler._update_requests_with_
    invalid_blocks cuts num_computed_tokens back, but the step already scheduled behind the bad one is
    not marked stale (as _preempt_request marks it), so update_from_output appends that step's token,
    computed from the corrupted KV. The canary reports it all the same; README "vLLM: one flag" says to
    use "fail" (or turn async scheduling off) where a healed answer matters. This test follows vLLM:
    when a release heals it, it fails, and the README's advice changes."""
    e = serve(model, {"a": (A, 12), "b": (B, 12)}, async_scheduling=True, fault=flip_at(4, "a", 1),
              policy="recompute", extra={"verdicts": "step"})
    assert e.finished == {"a": "length", "b": "length"} and e.outputs["b"] == clean["b"]
    assert [f["request_id"] for f in e.worker.failed] == ["a"]
    assert e.outputs["a"][:3] == clean["a"][:3] and e.outputs["a"] != clean["a"]


def test_log_mode_reports_and_lets_vllm_serve_on(model):
    e = serve(model, {"a": (A, 12)}, fault=flip_at(4, "a", 1), extra={"mode": "log"})
    assert e.finished == {"a": "length"} and not any(e.invalid)
    assert [f["reported"] for f in e.worker.failed] == [False] * len(e.worker.failed) and e.worker.failed


def test_composes_under_multiconnector(model, clean):
    e = serve(model, {"a": (A, 12), "b": (B, 12)}, fault=flip_at(4, "a", 1), connector="MultiConnector")
    assert type(e.worker).__name__ == "MultiConnector" and isinstance(e.canary_connector, KvCanaryConnector)
    assert e.finished == {"a": "error", "b": "length"} and e.outputs["b"] == clean["b"]


def test_the_guides_flags_load_through_vllms_factory():
    """docs/engines/vllm.md's two flags, as a user copies them, load the connector through vLLM's own
    factory (and its KVTransferConfig's checks)."""
    import json
    import re

    from vllm.config import KVTransferConfig

    from tests.support.docblocks import block
    one = block("vllm-flag").code.splitlines()
    assert one[0] == "pip install kvcanary"
    flag = re.fullmatch(r"vllm serve MODEL --kv-transfer-config '([^']*)'", one[1]).group(1)
    assert KVConnectorFactory.get_connector_class(KVTransferConfig(**json.loads(flag))) is KvCanaryConnector
    beside = re.fullmatch(r"--kv-transfer-config '([^']*)'", block("vllm-multiconnector").code).group(1)
    multi = KVTransferConfig(**json.loads(beside))
    assert KVConnectorFactory.get_connector_class(multi).__name__ == "MultiConnector"
    children = [KVConnectorFactory.get_connector_class(KVTransferConfig(**c))
                for c in multi.kv_connector_extra_config["connectors"]]
    assert children[0] is KvCanaryConnector and children[1].__name__ == "OffloadingConnector"


def test_settings_come_from_extra_config_and_are_checked(model):
    e = engine(model, extra={"layers": "all", "hash_mode": "all", "ring_capacity": 128})
    w = e.worker
    assert w.config.hash_mode == kc.HashMode.ALL and w.config.ring_capacity == 128 and w.layers == "all"
    assert len(w.canary.groups["FULL"].k_sources) == 2
    with pytest.raises(kc.ValidationError, match=r"kv-canary: kv_connector_extra_config takes .*unknown keys "
                                                 r"\['layer'\]\. Fix: remove"):
        engine(model, extra={"layer": "all"})
    with pytest.raises(kc.ValidationError, match="device: the canary runs on each worker's own GPU"):
        connector_settings({"device": 0}, max_num_seqs=8, max_model_len=256, async_scheduling=False)
    with pytest.raises(kc.ValidationError, match=r"kv-canary: .*mode"):
        engine(model, extra={"mode": "shout"})
    with pytest.raises(kc.ValidationError, match="verdicts must be one of"):
        connector_settings({"verdicts": "later"}, max_num_seqs=8, max_model_len=256, async_scheduling=True)
    assert connector_settings({}, max_num_seqs=8, max_model_len=256, async_scheduling=True)[2] == "next"


def test_refuses_what_it_cannot_cover(model):
    e = engine(model)
    cfg, kcc = e.config, e.kv_cache_config
    with pytest.raises(kc.ValidationError, match=r"kv_role.*kv_producer.*got 'kv_both'"):
        cfg.kv_transfer_config.kv_role = "kv_both"
        KvCanaryConnector(cfg, KVConnectorRole.SCHEDULER, kcc)
    cfg.kv_transfer_config.kv_role = "kv_producer"
    two = SimpleNamespace(kv_cache_groups=[kcc.kv_cache_groups[0]] * 2)
    with pytest.raises(kc.ValidationError, match="covers one KV cache group, got 2"):
        KvCanaryConnector(cfg, KVConnectorRole.WORKER, two)
    enc = SimpleNamespace(**{k: getattr(cfg, k) for k in ("kv_transfer_config", "scheduler_config", "cache_config")},
                          model_config=SimpleNamespace(is_encoder_decoder=True, max_model_len=256))
    with pytest.raises(kc.ValidationError, match="encoder-decoder"):
        KvCanaryConnector(enc, KVConnectorRole.SCHEDULER, kcc)


def test_scheduler_notes_send_only_the_scheduled_prompt_tokens():
    req = SimpleNamespace(request_id="x", all_token_ids=[5, 6, 7, 8, 9])
    notes = SchedulerNotes()
    notes.add(req)

    def out(new, computed, counts, blocks=None):
        return SimpleNamespace(
            scheduled_new_reqs=new, finished_req_ids={"old"}, preempted_req_ids=None,
            scheduled_cached_reqs=SimpleNamespace(req_ids=["x"], new_block_ids=[blocks], num_computed_tokens=[computed]),
            num_scheduled_tokens=counts, scheduled_spec_decode_tokens={}, total_num_scheduled_tokens=sum(counts.values()))
    n = SimpleNamespace(req_id="n", block_ids=([3, 4],), num_computed_tokens=16, prefill_token_ids=list(range(40)))
    s = notes.build(out([n], 3, {"n": 4, "x": 1}))
    # n: only the chunk 16..19 of its prompt; x decodes: its newest token is not sent (-1)
    assert s.tokens == [16, 17, 18, 19, -1] and s.ids == ["n", "x"] and s.blocks == [(0, [3, 4])]
    assert s.fresh == 1 and s.computed == [16, 3] and s.scheduled == [4, 1] and s.dropped == ["old"]
    s = notes.build(out([], 2, {"x": 3}, ([7],)))    # x's next prompt chunk (positions 2..4), a new block
    assert s.tokens == [7, 8, 9] and s.scheduled == [3] and s.blocks == [(0, [7])] and s.fresh == 0
    s = notes.build(out([], 5, {"x": 1}))            # a decode step: nothing per request but its lengths
    assert s.tokens is None and s.scheduled is None and s.blocks == [] and s.computed == [5]


@pytest.mark.gpu
@pytest.mark.skipif(gpu_unavailable_reason() is not None, reason="needs a CUDA GPU")
@pytest.mark.parametrize("verdicts", ["step", "next"])
def test_gpu_detection_with_a_graph_replayed_forward(model, clean, verdicts):
    e = serve(model, {"a": (A, 12), "b": (B, 12)}, fault=flip_at(4, "a", 1), device=0, graphs=True,
              extra={"verdicts": verdicts})
    assert e.worker.canary.device == 0
    assert e.finished == {"a": "error", "b": "length"} and e.outputs["b"] == clean["b"]
    assert len(e.outputs["a"]) == (3 if verdicts == "step" else 4)
    assert e.outputs["a"][:3] == clean["a"][:3] and e.outputs["a"][3:] != clean["a"][3:4]
    assert [f["request_id"] for f in e.worker.failed] == ["a"]


@pytest.mark.gpu
@pytest.mark.skipif(gpu_unavailable_reason() is not None, reason="needs a CUDA GPU")
def test_gpu_clean_run_and_recompute(model, clean):
    prompts = {"a": (A, 12), "b": (B, 12)}
    e = serve(model, prompts, device=0, graphs=True)
    e.worker.canary.flush()
    assert e.outputs == clean and e.worker.canary.stats()["violations"] == 0
    e = serve(model, prompts, fault=flip_at(4, "a", 1), device=0, graphs=True, policy="recompute")
    assert e.outputs == clean and len(e.worker.failed) == 1
