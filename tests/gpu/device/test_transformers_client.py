"""GPU tier of the transformers client: the scenarios of tests/test_transformers_cpu.py (clean
generation with the same tokens as without the canary, the same schedule and tokens under a small
block pool, a flipped KV byte, a corrupted read index, a wrong input token and one request's token
written into another's block, each reported in the step it is read, a request failed in mode
fail_request, every request with the tokens of a run with no canary in which the engine itself
ends the same request at the same step, through the same steps, and the compiled run) with a bf16
Llama on CUDA, where the canary runs the kernels on the engine's compute stream. Each runs in
the engine's plain configuration and in its fast ones (CUDA graphs; CUDA graphs with async
batching), the step's Batch staged in one launch (the default); the plain configuration also with
the Batch built by torch ops (stage_on_device=False).
"""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("torch")

from kvcanary.adapters.transformers_layout import check_transformers_version  # noqa: E402
from kvcanary.errors import ValidationError  # noqa: E402

try:  # a machine with a transformers outside the supported range skips (the range check is tested on the CPU)
    check_transformers_version(transformers.__version__)
except ValidationError as exc:
    pytest.skip(str(exc).splitlines()[0], allow_module_level=True)

from kvcanary.adapters import TransformersCanary  # noqa: E402
from tests import test_transformers_cpu  # noqa: E402
from tests.test_transformers_cpu import SCENARIOS  # noqa: E402

pytestmark = pytest.mark.gpu


class TorchOpsCanary(TransformersCanary):
    """The client with each step's Batch built by torch ops (the reference path)."""

    def __init__(self, model, **kwargs):
        super().__init__(model, stage_on_device=False, **kwargs)


ENGINE = {"plain": {}, "graphs": dict(use_cuda_graph=True),
          "graphs+async": dict(use_cuda_graph=True, use_async_batching=True)}
CASES = [(scenario, engine, True) for scenario in SCENARIOS for engine in ENGINE]
CASES += [(scenario, "plain", False) for scenario in SCENARIOS] + [(SCENARIOS[0], "graphs+async", False)]


@pytest.mark.parametrize("scenario,engine,staged", CASES,
                         ids=lambda v: v.__name__ if callable(v) else ({True: "staged", False: "torch-ops"}.get(v, v)))
def test_transformers_cuda(scenario, engine, staged, monkeypatch):
    monkeypatch.setattr(test_transformers_cpu, "CONFIG", {**test_transformers_cpu.CONFIG, **ENGINE[engine]})
    if not staged:
        monkeypatch.setattr(test_transformers_cpu, "TransformersCanary", TorchOpsCanary)
    scenario("cuda")


def test_transformers_cuda_compiled():
    test_transformers_cpu.compiled_same_tokens("cuda")


# ---- the canary inside the engine's CUDA graphs (issue 46) ----------------------------------------------
FAST = ENGINE["graphs+async"]


def _launches_by_step(tc):
    """after_step hook recording the canary's launches from the host so far, per step (and the
    canary itself, last: ``detach`` lets it go)."""
    seen, canary = [], []

    def after(info):
        seen.append(tc.canary.launch_count)
        canary[:] = [tc.canary]
    return seen, canary, after


def test_a_replayed_step_launches_only_the_pump_snapshot_from_the_host():
    """Catches a canary that runs its step launches from the host around the engine's graph replay
    (5-6 launches and a Python pass over the batch a step): in the fast configuration the stager,
    HEAD and TAIL are captured into the engine's own graphs, so a replayed step adds one launch
    (the pump's snapshot), and the generation is clean with the tokens of a run without it. (Steps
    of a shape captured during the generation run the canary eagerly once, then capture it.)"""
    model = test_transformers_cpu.make_model("cuda")
    prompts = test_transformers_cpu.make_prompts(12, seed=11)
    plain = test_transformers_cpu.generate(model, prompts, max_new_tokens=24, **FAST)
    tc = TransformersCanary(model, layers="all")
    seen, canary, tc.after_step = _launches_by_step(tc)
    guarded = test_transformers_cpu.generate(model, prompts, max_new_tokens=24, canary=tc, **FAST)
    s = tc.summary()
    assert tc.detections == [] and guarded == plain
    assert tc._in_forward, "expected the canary inside the runner's forward (CUDA cache, staged, not compiled)"
    per_step = [b - a for a, b in zip(seen, seen[1:])]
    replays = sum(n == 1 for n in per_step)
    assert replays >= 20, f"expected most steps to replay a captured graph (1 host launch), got {per_step}"
    # one Batch of the stager's capacity for every step shape: the canary packs its launches once
    assert {stage: len(cache) for stage, cache in canary[0].stages.packed.items()} == {"HEAD": 1, "TAIL": 1}
    assert s["verified_slots"] > 5000 and s["skipped_verifies"] == 0


def test_a_request_longer_than_the_map_regrows_it_and_recaptures_the_graphs():
    """Catches a map that a captured graph outgrows: the staged map is allocated up front (a
    captured step cannot allocate; at least 256 columns); a request longer than it grows the map,
    and the engine's graphs that captured the old one are dropped and captured again, so the run
    stays clean and complete (tests/test_transformers_graphs.py checks the same in the emulator)."""
    from kvcanary.adapters import transformers_paged
    model = test_transformers_cpu.make_model("cuda")
    prompts = test_transformers_cpu.make_prompts(6, seed=12, longest=300)
    plain = test_transformers_cpu.generate(model, prompts, max_new_tokens=12, **FAST)
    tc = TransformersCanary(model)
    grown = []
    grow = tc._grow_map
    tc._grow_map = lambda max_len: (grown.append(max_len), grow(max_len))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(transformers_paged, "_map_columns", lambda model, cache: 40)
        guarded = test_transformers_cpu.generate(model, prompts, max_new_tokens=12, canary=tc, **FAST)
    assert grown and grown[0] > 256, grown
    assert tc._batches.stager.columns >= max(len(p) for p in prompts) + 12
    assert tc.detections == [] and guarded == plain


def test_detach_drops_the_graphs_that_captured_the_canary():
    """Catches an engine left running the canary's captured launches after ``detach``: a persistent
    manager's graphs are dropped on detach, and the next attach's generation captures them again
    with the canary in them (its steps verified, its prefix blocks read clean)."""
    model = test_transformers_cpu.make_model("cuda")
    prompts = test_transformers_cpu.make_prompts(6, seed=13, longest=30)
    gen = transformers.GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=-1)
    cb = transformers.ContinuousBatchingConfig(page_size=test_transformers_cpu.PAGE, num_blocks=128,
                                               max_batch_tokens=64, max_requests_per_batch=8, **FAST)
    tc = TransformersCanary(model)
    try:
        runs = []
        for _ in range(2):
            steps, verified = tc.steps, tc.summary()["verified_slots"]
            with tc:
                model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb,
                                     persistent_manager=True)
                io = tc._processor.inputs_and_outputs
                assert any(p.device_io.graphs._storage for p in io.io_pairs), "expected captured graphs"
                before = tc.canary.launch_count
            assert not any(p.device_io.graphs._storage for p in io.io_pairs), "detach must drop the captured graphs"
            runs.append((tc.steps - steps, tc.summary()["verified_slots"] - verified, before))
        assert all(steps > 0 and verified > 0 for steps, verified, _ in runs), runs
        assert tc.detections == []
    finally:
        model.destroy_cached_continuous_batching_manager()
