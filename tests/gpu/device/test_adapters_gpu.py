"""GPU tier: the engine adapters with torch CUDA tensors (and CuPy arrays) give what the host
reference gives for the same bytes: the same violation records, canary buffers and counters for
whole SGLang- and vLLM-style runs, the same stored fingerprints for every layout and dtype, and
the same block-table expansion, computed on the device without a host round trip.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import kvcanary as kc
from kvcanary.adapters import (block_table_to_req_to_token, sglang_canary, sglang_sources, vllm_batch,
                               vllm_canary, vllm_layer_sources)
from tests.test_adapters import (ALL, SGLANG_FAULTS, Host, flip_layer2, rand, run_sglang, run_vllm,
                                 through_sources, vllm_bad_table, vllm_cache, vllm_flip)

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")


class Cuda:
    """torch CUDA backend of the simulations."""

    @staticmethod
    def arr(a):
        return torch.from_numpy(np.ascontiguousarray(a)).cuda()

    @staticmethod
    def flip(token, byte: int) -> None:
        token.view(torch.uint8).reshape(-1)[byte] ^= 0x5A

    @staticmethod
    def sync() -> None:
        torch.cuda.synchronize()


class CuPy:
    """CuPy backend: a pipeline in which no torch tensor appears."""

    @staticmethod
    def arr(a):
        import cupy
        return cupy.asarray(np.ascontiguousarray(a))

    @staticmethod
    def flip(token, byte: int) -> None:
        import cupy
        token.view(cupy.uint8).reshape(-1)[byte] ^= 0x5A

    @staticmethod
    def sync() -> None:
        import cupy
        cupy.cuda.Device().synchronize()


def _key(r: dict) -> tuple:
    return (r["step"], r["launch_tag"], r["slot_idx"], r["position"], r["fail_reason_bits"], r["stored_token"],
            r["expected_token"], r["stored_chain_hash"], r["expected_aux"])


def assert_same_run(host_run, device_run) -> None:
    (host_records, host), (dev_records, dev) = host_run, device_run
    assert sorted(map(_key, dev_records)) == sorted(map(_key, host_records))
    for name, ctx in host.ctx.items():
        np.testing.assert_array_equal(dev.ctx[name].buffer.host_words(), ctx.buffer.host_words(), err_msg=str(name))
    for k in ("verified_slots", "protected_tokens", "violations"):
        assert dev.stats()[k] == host.stats()[k], k


CLEAN = [(k, None, "all", None) for k in ("mha", "mla", "fp8", "swa")]


@pytest.mark.parametrize("kind,buffer,layers,tag", SGLANG_FAULTS + CLEAN)
@pytest.mark.parametrize("mode", ["partial", "all"])
def test_sglang_runs_on_cuda_equal_host(kind, buffer, layers, tag, mode):
    def run(be):
        corrupt = None if buffer is None else flip_layer2(buffer, {})
        return run_sglang(kind, be, corrupt=corrupt, layers=layers, swa_layers=layers, hash_mode=mode)
    host, dev = run(Host), run(Cuda)
    assert_same_run(host, dev)
    assert bool(dev[0]) == (tag is not None)


@pytest.mark.parametrize("backend", [Cuda, CuPy], ids=["torch", "cupy"])
@pytest.mark.parametrize("fault", ["clean", "kv_byte", "block_table"])
def test_vllm_runs_on_device_equal_host(backend, fault):
    if backend is CuPy:
        pytest.importorskip("cupy")

    def run(be):
        corrupt = {"clean": None, "kv_byte": vllm_flip({}), "block_table": vllm_bad_table}[fault]
        return run_vllm(be, corrupt=corrupt, layers="all", hash_mode="all")
    host, dev = run(Host), run(backend)
    assert_same_run(host, dev)
    assert bool(dev[0]) == (fault != "clean")


def stamp_all(canary, num_slots: int) -> None:
    """One request writing slots 1..num_slots-1 in order (so every TAIL record holds a fingerprint)."""
    n = num_slots - 1
    rtt = np.zeros((2, num_slots), np.int32)
    rtt[1, :n] = np.arange(1, num_slots)
    a = lambda x: torch.as_tensor(x, device="cuda")  # noqa: E731
    batch = kc.Batch(a(np.array([1])), a(np.array([0])), a(np.array([n])), a(rtt),
                     input_ids=a(np.arange(n) + 100), positions=a(np.arange(n)),
                     out_cache_loc=a(np.arange(1, num_slots)))
    canary.before_forward(batch)
    canary.after_forward(batch)
    canary.flush()


def stored_fingerprints(canary, half: str, num_slots: int) -> list[int]:
    """REAL_KV_HASH of slots 1..num_slots-1 in the TAIL buffer of ``half``, as uint64."""
    words = canary.ctx["TAIL", "FULL", half, "write"].buffer.host_words()
    return [int(x) for x in words[1:num_slots, kc.abi.FIELD_REAL_KV_HASH].view(np.uint64)]


@pytest.mark.parametrize("layout", ["nhd", "flashinfer", "hnd", "mla"])
def test_vllm_layouts_on_cuda_equal_host_reference(layout):
    raw, cache, _ = vllm_cache(np.random.default_rng(7), layout)
    dev = Cuda.arr(raw)
    if layout == "hnd":
        dev = dev.permute(0, 1, 3, 2, 4)  # the engine's logical view of an HND allocation
    canary = vllm_canary([dev.view(torch.bfloat16)], hash_mode="all")
    stamp_all(canary, 48)
    k, v = vllm_layer_sources(cache)
    slots = list(range(1, 48))
    assert stored_fingerprints(canary, "K", 48) == through_sources([k], slots, ALL, 48)
    if v is not None:
        assert stored_fingerprints(canary, "V", 48) == through_sources([v], slots, ALL, 48)


@pytest.mark.parametrize("layout", ["LBNHC", "LHBNC", "BLHNC"])
def test_vllm_packed_layouts_on_cuda_equal_host_reference(layout):
    """vLLM main's packed per-layer views of one shared buffer: the kernels fingerprint the bytes the
    host reference reads for the same layout (head 0's K and V of every token of every layer)."""
    from tests.test_adapters_upstream import packed_caches
    raw, host = packed_caches(layout)
    dev_raw = raw.cuda().view(torch.bfloat16)
    dev = [torch.as_strided(dev_raw, c.shape, c.stride(), c.storage_offset()) for c in host]
    slots = host[0].shape[0] * host[0].shape[2]
    canary = vllm_canary(dev, layout=layout, layers="all", hash_mode="all")
    stamp_all(canary, slots)
    pairs = [vllm_layer_sources(c, layout=layout) for c in host]
    for half, srcs in (("K", [k for k, _ in pairs]), ("V", [v for _, v in pairs])):
        assert stored_fingerprints(canary, half, slots) == through_sources(srcs, list(range(1, slots)), ALL, slots)


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_sglang_dtypes_on_cuda_equal_host_reference(dtype):
    rng = np.random.default_rng(8)
    store = np.int16 if dtype == "bfloat16" else np.uint8
    host = SimpleNamespace(k_buffer=[rand(rng, (40, 2, 32), store) for _ in range(2)],
                           v_buffer=[rand(rng, (40, 2, 32), store) for _ in range(2)])
    if dtype != "bfloat16":  # a quantised pool: fp8 values and their scales
        host.k_scale_buffer = [rand(rng, (40, 16), np.uint8) for _ in range(2)]
        host.v_scale_buffer = [rand(rng, (40, 16), np.uint8) for _ in range(2)]
    dev = SimpleNamespace(**{name: [Cuda.arr(b).view(getattr(torch, dtype)) if "scale" not in name else Cuda.arr(b)
                                    for b in bufs] for name, bufs in vars(host).items()})
    canary = sglang_canary(dev, layers="all", hash_mode="all")
    stamp_all(canary, 40)
    k, v = sglang_sources(host, layers="all")
    slots = list(range(1, 40))
    assert stored_fingerprints(canary, "K", 40) == through_sources(k, slots, ALL, 40)
    assert stored_fingerprints(canary, "V", 40) == through_sources(v, slots, ALL, 40)


def _table(seed: int):
    rng = np.random.default_rng(seed)
    return rng.integers(1, 1000, (16, 12)).astype(np.int32), rng.integers(0, 12 * 16 + 1, 16).astype(np.int32)


def test_block_table_expansion_on_cuda_is_capturable_and_equals_numpy():
    bt, seq = _table(9)
    got = block_table_to_req_to_token(Cuda.arr(bt), Cuda.arr(seq), 16)
    assert got.is_cuda and got.dtype == torch.int32
    np.testing.assert_array_equal(got.cpu().numpy(), block_table_to_req_to_token(bt, seq, 16))
    # Captured into a CUDA graph: capture fails on any host synchronisation, and a replay with new
    # block-table contents gives the new map at the same address.
    bt_d, seq_d = Cuda.arr(bt), Cuda.arr(seq)
    out = torch.zeros((17, 192), dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        block_table_to_req_to_token(bt_d, seq_d, 16, out=out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        block_table_to_req_to_token(bt_d, seq_d, 16, out=out)
    bt2, seq2 = _table(10)
    bt_d.copy_(torch.from_numpy(bt2))
    seq_d.copy_(torch.from_numpy(seq2))
    graph.replay()
    torch.cuda.synchronize()
    np.testing.assert_array_equal(out.cpu().numpy(), block_table_to_req_to_token(bt2, seq2, 16))


def test_block_table_expansion_with_cupy_equals_numpy():
    cupy = pytest.importorskip("cupy")
    bt, seq = _table(11)
    got = block_table_to_req_to_token(cupy.asarray(bt), cupy.asarray(seq), 16, max_len=150)
    assert isinstance(got, cupy.ndarray)
    np.testing.assert_array_equal(cupy.asnumpy(got), block_table_to_req_to_token(bt, seq, 16, max_len=150))


def test_vllm_batch_on_cuda_equals_host():
    bt, seq = _table(12)
    rng = np.random.default_rng(12)
    q = rng.integers(0, 4, 16)
    t = int(q.sum()) + 3  # three padding tokens past the requests' own
    meta = dict(block_table=bt, seq_lens=np.maximum(seq, q).astype(np.int32),
                query_start_loc=np.concatenate([[0], np.cumsum(q)]).astype(np.int32),
                slot_mapping=rng.integers(-1, 5000, t), input_ids=rng.integers(0, 9, t).astype(np.int32),
                positions=rng.integers(0, 99, t))
    host = vllm_batch(**meta, block_size=16, num_tokens=int(q.sum()))
    dev = vllm_batch(**{k: Cuda.arr(v) for k, v in meta.items()}, block_size=16, num_tokens=int(q.sum()))
    for name in ("req_pool_indices", "prefix_lens", "extend_lens", "req_to_token", "input_ids", "positions",
                 "out_cache_loc"):
        d = getattr(dev, name)
        assert d.is_cuda, name
        np.testing.assert_array_equal(d.cpu().numpy(), getattr(host, name), err_msg=name)
