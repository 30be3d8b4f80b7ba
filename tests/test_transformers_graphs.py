"""The transformers client's CUDA-graph path on the CPU: the real engine (transformers continuous
batching, a small Llama) with its graph path on, where each captured step replays the canary's
launches, memcpy and memset nodes in the emulated kernels (tests/emu behind tests/support/fake_cuda.py)
and the model's forward itself, as a CUDA graph replays them; host code of the canary runs only in
eager and captured steps. The cache's CPU tensors are seen as device memory (the fake driver's
memory is host memory), the compute stream is a stand-in, and ``torch.compile``/async batching
stay off (async batching needs a CUDA device). The scenarios are tests/test_transformers_cpu.py's,
so every check there (clean runs with the tokens of runs without the canary, each fault reported
in the step it is read, a failed request) holds for steps the canary never saw on the host.
"""

from __future__ import annotations

import contextlib
import ctypes

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from tests import emu  # noqa: E402
from tests import test_transformers_cpu as scenarios  # noqa: E402

if emu.unavailable_reason() is not None:
    pytest.skip(f"the kernel emulator: {emu.unavailable_reason()}", allow_module_level=True)

STREAM = 0x5000  # the stand-in compute stream's handle


class Stream:
    """The engine's compute stream, stood in for: a handle, and synchronise runs what is queued."""

    def __init__(self, fake):
        self.fake, self.cuda_stream, self.device = fake, STREAM, "cuda:0"

    def synchronize(self):
        self.fake.run()

    def wait_stream(self, other):
        pass


class Graph:
    """A CUDA graph of the fake driver: what was captured on the stream (the canary's launches and
    copies, and the model's forward as one node), replayed in order."""

    def __init__(self, fake):
        self.fake, self.ops = fake, []

    def replay(self):
        self.fake.replay(self.ops, STREAM)
        REPLAYS[0] += 1
        LAST[0] = any(isinstance(op, tuple) and op[0] == "kvc_stage_paged" for op in self.ops)

    def reset(self):
        self.ops = []


REPLAYS = [0, 0]  # graph replays; canary steps that were replays of a graph holding the canary's launches
LAST = [None]     # whether the graph replayed last held the canary's staging launch


@pytest.fixture
def graphs_on_cpu(monkeypatch):
    """The engine's graph path with the fake driver and the emulated kernels (see the module docstring)."""
    from transformers.generation.continuous_batching import initialization, input_outputs, model_runner

    from kvcanary.adapters import transformers_paged
    from kvcanary.interop import arrays
    from tests.support import fake_cuda
    fake = fake_cuda.install(monkeypatch)
    fake.kernels, fake.immediate = emu.Kernels(), True
    monkeypatch.setattr(arrays, "_torch_ordinal", lambda obj: 0)
    monkeypatch.setattr(transformers_paged, "_cache_device", lambda cache: 0)
    monkeypatch.setattr(initialization, "get_accelerator_graph_name", lambda: "cuda")
    monkeypatch.setattr(model_runner, "get_memory_pools", lambda: (None, None))
    monkeypatch.setattr(model_runner, "memory_pool_context", lambda pool: contextlib.nullcontext())
    monkeypatch.setattr(model_runner, "stream_context", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(model_runner, "create_accelerator_graph", lambda: Graph(fake))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: bool(fake.capturing))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: None)

    def host_view(a):  # the callbacks' torch twins of the stager's buffers: fake device memory is host memory
        raw = (ctypes.c_char * (a.dtype.itemsize * int(np.prod(a.shape)))).from_address(a.ptr)
        return torch.from_numpy(np.frombuffer(raw, dtype=a.dtype).reshape(a.shape))
    monkeypatch.setattr(torch, "from_dlpack", host_view)

    @contextlib.contextmanager
    def capture(graph, stream=None, pool=None):
        fake.capturing.add(STREAM)
        start = len(fake.captured)
        try:
            yield
        finally:
            fake.capturing.discard(STREAM)
            graph.ops = fake.captured[start:]
    monkeypatch.setattr(model_runner, "accelerator_graph_capture_context", capture)

    forward = model_runner.ModelRunner._forward_process_and_sample

    def forward_node(self, *args):  # captured: a node that runs the forward at each replay
        if fake.capturing:
            fake.captured.append(lambda: forward(self, *args))
            return None
        return forward(self, *args)
    monkeypatch.setattr(model_runner.ModelRunner, "_forward_process_and_sample", forward_node)

    init = input_outputs.ContinuousBatchingIOs.__init__

    def with_stream(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.compute_stream = Stream(fake)
    monkeypatch.setattr(input_outputs.ContinuousBatchingIOs, "__init__", with_stream)
    monkeypatch.setattr(scenarios, "CONFIG", dict(use_cuda_graph=True, use_async_batching=False,
                                                  max_blocks_per_request=0))
    def around(*args, **kwargs):
        raise AssertionError("expected the canary in the runner's forward, not around compute_batch")
    monkeypatch.setattr(transformers_paged.TransformersCanary, "_step_around", around)
    step = transformers_paged.TransformersCanary._step

    def checked_step(tc, *args):
        LAST[0] = None
        step(tc, *args)
        if tc._eager is None:  # no eager canary: the step was a replay, whose graph must hold the canary
            assert LAST[0] is True, "a replayed step's graph did not hold the canary's launches"
            REPLAYS[1] += 1
    monkeypatch.setattr(transformers_paged.TransformersCanary, "_step", checked_step)
    REPLAYS[:] = [0, 0]
    yield fake
    fake_cuda.release(fake)


@pytest.mark.parametrize("scenario", scenarios.SCENARIOS, ids=lambda f: f.__name__)
def test_transformers_scenarios_with_the_canary_in_the_engines_graphs(graphs_on_cpu, scenario):
    scenario("cpu")
    assert REPLAYS[0] > 10, "expected the engine to replay captured graphs"
    assert REPLAYS[1] > 10, "expected canary steps replayed from the engine's graphs"


def test_a_request_longer_than_the_map_regrows_it_and_the_graphs_are_captured_again(graphs_on_cpu, monkeypatch):
    """Catches a captured graph left naming a map that grew (its launches would read the freed map,
    or verify against a map the new steps no longer fill): the map is allocated up front, and a
    request longer than it grows it, drops the engine's graphs and lets the engine capture them
    again; the run stays clean, with the tokens of a run without the canary."""
    from kvcanary.adapters import transformers_paged
    monkeypatch.setattr(transformers_paged, "_map_columns", lambda model, cache: 40)
    grown = []
    grow = transformers_paged.TransformersCanary._grow_map

    def counted(tc, max_len):
        grown.append((max_len, sum(len(d.graphs._storage) for d in tc._device_ios())))
        grow(tc, max_len)
        assert not any(d.graphs._storage for d in tc._device_ios()), "the graphs of the old map must go"
    monkeypatch.setattr(transformers_paged.TransformersCanary, "_grow_map", counted)
    model = scenarios.make_model("cpu")
    prompts = scenarios.make_prompts(6, seed=12, longest=300)  # past the map's 256 columns (its least)
    plain = scenarios.generate(model, prompts, max_new_tokens=12)
    tc = scenarios.TransformersCanary(model)
    guarded = scenarios.generate(model, prompts, max_new_tokens=12, canary=tc)
    assert grown and grown[0][0] > 256 and grown[0][1] > 0, grown
    assert tc.detections == [] and guarded == plain
    assert tc._batches.stager.columns >= max(len(p) for p in prompts) + 12
    assert REPLAYS[1] > 10


def _mla_scenarios():
    from transformers.generation.continuous_batching import cache_allocators
    if not hasattr(cache_allocators, "MLACacheAllocator"):
        return [pytest.param(None, marks=pytest.mark.skip(reason=f"transformers {transformers.__version__} has no "
                                                                 f"MLACacheAllocator (5.25 added it)"))]
    from tests.test_transformers_mla import MLA_SCENARIOS
    return MLA_SCENARIOS


@pytest.mark.parametrize("scenario", _mla_scenarios(), ids=lambda f: getattr(f, "__name__", "mla"))
def test_mla_scenarios_with_the_canary_in_the_engines_graphs(graphs_on_cpu, scenario):
    """tests/test_transformers_mla.py's scenarios (a DeepSeek-V3-shaped model, one cache row per token)
    with the step staged on the (emulated) device and the canary inside the engine's graphs."""
    scenario("cpu")
    assert REPLAYS[1] > 10, "expected canary steps replayed from the engine's graphs"


def test_a_lost_store_in_the_engines_graphs_fails_its_request(graphs_on_cpu):
    """Issue 43 in the graph path: layer 0's store of one decode token redirected to the write trash
    by a device op of the layer's store (tests/test_transformers_lost_write.py) — the emulated TAIL
    write of that step reports lost_write at its slot and that request ends FAILED."""
    from tests.test_transformers_lost_write import lost_store
    lost_store("cpu")
    assert REPLAYS[1] > 10, "expected canary steps replayed from the engine's graphs"
