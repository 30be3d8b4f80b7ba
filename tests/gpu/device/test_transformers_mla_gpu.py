"""GPU tier of the transformers client on an MLA model (transformers >= 5.25, ``MLACacheAllocator``): the
scenarios of tests/test_transformers_mla.py (clean generation with the tokens of a run without the
canary, a flipped KV-latent bit and a wrong block restore each reported in the step that reads
them, a failed request alone and counted once, every request with the tokens of a run with no
canary in which the engine itself ends the same request at the same step, through the same steps)
with a bf16 DeepSeek-V3-shaped model on CUDA, in the engine's plain configuration and its fast ones
(CUDA graphs; CUDA graphs with async batching), the step staged in one launch (the default); the
plain configuration also with the Batch built by torch ops. Then the fast configuration's launch
count: a replayed step adds the pump's snapshot only.
"""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("torch")

# test_transformers_client skips at import (so this module with it) outside the supported transformers range
from tests.gpu.device.test_transformers_client import ENGINE, FAST, TorchOpsCanary, _launches_by_step  # noqa: E402
from tests import test_transformers_cpu  # noqa: E402

mla = pytest.importorskip("tests.test_transformers_mla")  # skips (module level) without MLACacheAllocator

pytestmark = pytest.mark.gpu

CASES = [(scenario, engine, True) for scenario in mla.MLA_SCENARIOS for engine in ENGINE]
CASES += [(scenario, "plain", False) for scenario in mla.MLA_SCENARIOS]


@pytest.mark.parametrize("scenario,engine,staged", CASES,
                         ids=lambda v: v.__name__ if callable(v) else ({True: "staged", False: "torch-ops"}.get(v, v)))
def test_transformers_mla_cuda(scenario, engine, staged, monkeypatch):
    monkeypatch.setattr(test_transformers_cpu, "CONFIG", {**test_transformers_cpu.CONFIG, **ENGINE[engine]})
    if not staged:
        monkeypatch.setattr(mla, "TransformersCanary", TorchOpsCanary)
        monkeypatch.setattr(test_transformers_cpu, "TransformersCanary", TorchOpsCanary)
    scenario("cuda")


def test_an_mla_step_replayed_from_the_engines_graph_launches_only_the_pump_snapshot():
    """The fast configuration with the MLA model: the canary inside the engine's graphs (a replayed
    step adds one host launch), the same tokens as without it, nothing reported."""
    model = mla.make_mla_model("cuda")
    prompts = test_transformers_cpu.make_prompts(12, seed=11)
    plain = test_transformers_cpu.generate(model, prompts, max_new_tokens=24, **FAST)
    tc = mla.TransformersCanary(model, layers="all")
    seen, _, tc.after_step = _launches_by_step(tc)
    guarded = test_transformers_cpu.generate(model, prompts, max_new_tokens=24, canary=tc, **FAST)
    assert tc.detections == [] and guarded == plain
    assert tc._in_forward and tc.layout.halves == ("K",)
    per_step = [b - a for a, b in zip(seen, seen[1:])]
    assert sum(n == 1 for n in per_step) >= 20, f"expected most steps to replay a captured graph, got {per_step}"
