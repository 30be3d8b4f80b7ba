"""GPU tier of the transformers client: the scenarios of tests/test_transformers_cpu.py (clean
generation with the same tokens as without the canary, the same schedule and tokens under a small
block pool, a flipped KV byte, a corrupted read index and a wrong input token, each reported in the
step it is read) with a bf16 Llama on CUDA, where the canary runs the kernels on the compute stream;
each with the step's Batch staged in one launch (the default) and built by torch ops
(stage_on_device=False).
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


@pytest.mark.parametrize("staged", [False, True], ids=["torch-ops", "staged"])
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda f: f.__name__)
def test_transformers_cuda(scenario, staged, monkeypatch):
    if not staged:
        monkeypatch.setattr(test_transformers_cpu, "TransformersCanary", TorchOpsCanary)
    scenario("cuda")
