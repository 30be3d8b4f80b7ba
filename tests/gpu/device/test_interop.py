"""GPU tier: the same workloads through torch, CuPy, JAX (DLPack) and raw pointers, each equal to
the CPU reference; launch capture in a torch CUDA graph; no torch needed for library arrays."""

from __future__ import annotations

import numpy as np
import pytest

import kvcanary as kc
from kvcanary import abi
from kvcanary.runtime import memory
from tests.support import workloads

pytestmark = pytest.mark.gpu
host = lambda a: a  # noqa: E731


def _host(a):
    if isinstance(a, np.ndarray):
        return a
    if hasattr(a, "get"):  # cupy
        return a.get()
    if hasattr(a, "cpu"):  # torch
        return a.cpu().numpy()
    return a.numpy()


def test_torch_tensors_equal_reference():
    torch = pytest.importorskip("torch")
    w = workloads.make(31, mode=abi.HashMode.ALL, num_sources=3)
    to = lambda a: torch.from_numpy(np.ascontiguousarray(a)).cuda()  # noqa: E731
    got = workloads.run(w, to, _host)
    workloads.assert_same(workloads.run(w, host, _host), got)


def test_torch_fp8_and_bf16_pools():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    ref_pool = rng.integers(0, 256, (4096, 2, 64), dtype=np.uint8)  # [slots, heads, dim] of 1-byte values
    for dtype, shape in ((torch.float8_e4m3fn, (4096, 2, 64)), (torch.bfloat16, (4096, 2, 32))):
        t = torch.from_numpy(ref_pool.copy()).cuda().view(dtype).view(*shape)
        src_dev = kc.source_from_slots(t, read_bytes=128)
        src_host = kc.source_from_slots(ref_pool, read_bytes=128)
        results = []
        for src, dev in ((src_host, None), (src_dev, 0)):
            buf = kc.CanaryBuffer.allocate(4096, device=dev)
            ctx = kc.VerifyContext(buf, kc.ViolationSink.allocate(device=dev), abi.LaunchTag.TAIL_V_FULL,
                                   [src], abi.HashMode.ALL)
            plan = kc.StepPlan.allocate(1, 16, device=dev)
            mk = (lambda a: a) if dev is None else memory.to_device
            plan.offsets, plan.seed = mk(np.array([0, 100], np.int64)), mk(np.array([-1], np.int64))
            plan.num_valid_reqs = mk(np.array([1], np.int32))
            kc.write(ctx, plan, mk(np.arange(100, dtype=np.int64)), mk(np.arange(100, dtype=np.int64)),
                     mk(np.arange(1, 101, dtype=np.int64)))
            results.append(_host(buf.array))
        np.testing.assert_array_equal(results[0], results[1])
        assert np.any(results[1].view(np.int64)[1:101, 3] != 0)


def test_cupy_arrays_equal_reference():
    cp = pytest.importorskip("cupy")
    w = workloads.make(32, mode=abi.HashMode.PARTIAL, num_sources=2)
    got = workloads.run(w, lambda a: cp.asarray(np.ascontiguousarray(a)), _host)
    workloads.assert_same(workloads.run(w, host, _host), got)


class _DLPackOnly:
    """Hides every protocol but DLPack, so the DLPack path is what gets exercised."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, **kw):
        return self._a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def test_jax_inputs_through_dlpack():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    jax.config.update("jax_enable_x64", True)
    w = workloads.make(33, mode=abi.HashMode.ALL, num_sources=1)

    def to(a):  # read-only inputs from JAX; state the canary writes stays library-owned
        a = np.ascontiguousarray(a)
        if a.dtype == np.int64 and a.ndim == 1 and a.size > 1:
            return _DLPackOnly(jax.device_put(jnp.asarray(a)))
        return memory.to_device(a)

    workloads.assert_same(workloads.run(w, host, _host), workloads.run(w, to, _host, to_state=memory.to_device))


def test_raw_pointers_equal_reference():
    keep = []

    def to(a):
        d = memory.to_device(np.ascontiguousarray(a))
        keep.append(d)
        return kc.from_pointer(d.ptr, d.shape, d.dtype, device=0, owner=d)

    def back(a):
        if isinstance(a, kc.ArrayView):
            out = np.empty(a.shape, a.dtype)
            return memory.copy_to_host_ptr(out, a.ptr, 0)
        return _host(a)

    w = workloads.make(34)
    workloads.assert_same(workloads.run(w, host, _host), workloads.run(w, to, back))


def test_library_arrays_export_cai_and_dlpack():
    cp = pytest.importorskip("cupy")
    torch = pytest.importorskip("torch")
    d = memory.to_device(np.arange(12, dtype=np.int64).reshape(3, 4))
    np.testing.assert_array_equal(cp.asarray(d).get(), np.arange(12).reshape(3, 4))
    t = torch.from_dlpack(d)
    assert t.device.type == "cuda" and t.data_ptr() == d.ptr
    t += 1
    np.testing.assert_array_equal(d.numpy(), np.arange(1, 13).reshape(3, 4))


def test_launch_captured_in_torch_cuda_graph():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(9)
    canary = torch.zeros((512, 32), dtype=torch.uint8, device="cuda")
    sink = kc.ViolationSink(torch.zeros((256, 8), dtype=torch.int64, device="cuda"),
                            torch.zeros(1, dtype=torch.int32, device="cuda"),
                            torch.zeros(1, dtype=torch.int64, device="cuda"),
                            torch.zeros(1, dtype=torch.int64, device="cuda"))
    ctx = kc.VerifyContext(kc.CanaryBuffer(canary), sink, abi.LaunchTag.HEAD_K_FULL, (), abi.HashMode.NONE)
    plan = kc.StepPlan(4, 64, 0, offsets=torch.zeros(5, dtype=torch.int64, device="cuda"),
                       seed=torch.full((4,), -1, dtype=torch.int64, device="cuda"),
                       num_valid_reqs=torch.zeros(1, dtype=torch.int32, device="cuda"))
    ids = torch.zeros(64, dtype=torch.int64, device="cuda")
    pos = torch.zeros(64, dtype=torch.int64, device="cuda")
    loc = torch.full((64,), -1, dtype=torch.int64, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        kc.write(ctx, plan, ids, pos, loc)  # warm-up outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        kc.write(ctx, plan, ids, pos, loc)
    canary.zero_()
    runs_before = int(sink.arrays[2].item())
    for step in range(3):  # new contents each replay, same buffers
        n = 10 + step
        plan.offsets.copy_(torch.tensor([0, n, n, n, n]))
        plan.num_valid_reqs.fill_(4)
        ids.copy_(torch.from_numpy(rng.integers(0, 1000, 64)))
        pos.copy_(torch.arange(64))
        loc.copy_(torch.from_numpy(np.concatenate([rng.permutation(np.arange(1, 512))[:n], -np.ones(64 - n, np.int64)])))
        g.replay()
        torch.cuda.synchronize()
        # the same write on the reference
        ref = np.zeros((512, 32), np.uint8)
        hsink = kc.ViolationSink.allocate(256)
        hctx = kc.VerifyContext(kc.CanaryBuffer(ref), hsink, abi.LaunchTag.HEAD_K_FULL, (), abi.HashMode.NONE)
        hplan = kc.StepPlan(4, 64, None, offsets=plan.offsets.cpu().numpy(), seed=plan.seed.cpu().numpy(),
                            num_valid_reqs=plan.num_valid_reqs.cpu().numpy())
        kc.write(hctx, hplan, ids.cpu().numpy(), pos.cpu().numpy(), loc.cpu().numpy())
        np.testing.assert_array_equal(canary.cpu().numpy(), ref)
        canary.zero_()
    assert int(sink.arrays[2].item()) == runs_before + 3
