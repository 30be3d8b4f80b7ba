"""GPU tier of issue 43's real-client check: with TransformersCanary in the engine's configurations —
plain, CUDA graphs, and CUDA graphs with async batching (the fast one) — a bf16 Llama on CUDA, layer
0's K/V store of one decode token redirected to the engine's write-trash index (a device op inside the
layer's store, replayed by the captured graphs; the engine's bookkeeping, which the canary stamps
from, unchanged). Expected (tests/test_transformers_lost_write.py's scenario, which also runs on the
CPU): ``lost_write`` rows at that token's slot from TAIL_K_FULL and TAIL_V_FULL in the step that lost
the store — under async batching that step or the one in flight when the hook ran, as the scenario
asserts — and with ``mode="fail_request"`` that request FAILED, every other FINISHED.
"""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from kvcanary.adapters.transformers_layout import check_transformers_version  # noqa: E402
from kvcanary.errors import ValidationError  # noqa: E402

try:  # a transformers outside the supported range skips (the range check is tested on the CPU)
    check_transformers_version(transformers.__version__)
except ValidationError as exc:
    pytest.skip(str(exc).splitlines()[0], allow_module_level=True)

from tests.gpu.device.test_transformers_client import ENGINE  # noqa: E402
from tests.test_transformers_lost_write import lost_store  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("engine", list(ENGINE))
def test_a_lost_decode_store_fails_its_request_on_cuda(engine):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    hit = lost_store("cuda", config=ENGINE[engine])
    print(f"[lost store {engine}] {hit}")
