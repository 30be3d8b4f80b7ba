"""GPU tier of the transformers client: the scenarios of tests/test_transformers_cpu.py (clean
generation with the same tokens as without the canary, the same schedule and tokens under a small
block pool, a flipped KV byte, a corrupted read index, a wrong input token and one request's token
written into another's block, each reported in the step it is read, and the compiled run) with a
bf16 Llama on CUDA, where the canary runs the kernels on the engine's compute stream. Each runs in
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
