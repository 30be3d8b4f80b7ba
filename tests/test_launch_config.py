"""Programmatic dependent launch (docs/performance.md, "Launch latency"): on sm_90+ kvcanary's
launches let the next kernel of the stream start during the previous one, which is safe only
because every kernel's first statement waits for the previous grid (KVC_AFTER_PREVIOUS_GRID).

Checked here without a GPU: every kernel of kernels_src/ begins with the wait; the wait is
compiled for sm_90+ and for no older arch; the driver layer asks for PDL exactly where the loaded
cubin has the wait (and ``KVCANARY_PDL`` is not 0); the launches of a manager step carry it.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import kvcanary as kc
from kvcanary import abi
from kvcanary.manager import canary as manager
from kvcanary.runtime import devices, launch
from kvcanary.runtime import nvrtc_build as kc_compile
from kvcanary.runtime import nvrtc_program
from tests.support import fake_cuda
from tests.test_abi_literals import strip_comments_and_strings
from tests.test_pump import make_canary, step, stream

WAIT = "KVC_AFTER_PREVIOUS_GRID();"
KERNEL = re.compile(r'extern\s+__global__[^{;]*\{')  # extern "C": the strings are blanked


def kernel_bodies():
    """(file, kernel name, the code after its opening brace) of every kernel of kernels_src/."""
    for name, text in kc_compile.read_sources().items():
        code = strip_comments_and_strings(text).replace("\\\n", "\n")
        for m in KERNEL.finditer(code):
            kernel = re.search(r"(\w+(?:##\w+)?)\s*\(\s*const\s+__grid_constant__", code[m.start():m.end()])
            yield name, kernel.group(1) if kernel else code[m.start():m.end()], code[m.end():]


def test_every_kernel_waits_for_the_previous_grid_first():
    found = list(kernel_bodies())
    names = {k for _, k, _ in found}
    assert "kvc_echo_##S" in names  # the echo kernels' macro
    assert {k for k in abi.KERNELS if not k.startswith("kvc_echo_")} <= names, set(abi.KERNELS) - names
    late = [f"{f}:{k}" for f, k, body in found if not body.lstrip().startswith(WAIT)]
    assert not late, f"kernels whose first statement is not {WAIT}: {late}"


def _ptx(arch: int) -> str:
    nvrtc = nvrtc_program._nvrtc()
    src = '#include "common.cuh"\nextern "C" __global__ void k(int* p) { KVC_AFTER_PREVIOUS_GRID(); *p = 1; }\n'
    headers = {nvrtc_program.PRELUDE_NAME: abi.render_prelude(), **kc_compile.read_sources()}
    err, prog = nvrtc.nvrtcCreateProgram(src.encode(), b"k.cu", len(headers), [v.encode() for v in headers.values()],
                                         [k.encode() for k in headers])
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS
    try:
        opts = [b"--std=c++17", f"--gpu-architecture=compute_{arch}".encode()]
        (result,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        assert result == nvrtc.nvrtcResult.NVRTC_SUCCESS, f"compute_{arch}: {result}"
        err, size = nvrtc.nvrtcGetPTXSize(prog)
        ptx = bytes(max(int(size), 2))
        nvrtc.nvrtcGetPTX(prog, ptx)
        return ptx.rstrip(b"\0").decode()
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


@pytest.mark.parametrize("arch", sorted({80, 90, *kc_compile.SUPPORTED_ARCHS}))
def test_the_wait_is_compiled_exactly_from_sm90(arch):
    if arch not in nvrtc_program.supported_archs():
        pytest.skip(f"this NVRTC cannot target sm_{arch}")
    ptx = _ptx(arch)
    has = "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx
    assert has == (arch * 10 >= abi.PDL_CUDA_ARCH), (arch, has)


@pytest.mark.parametrize("arch,env,want", [(80, None, False), (86, None, False), (90, None, True), (100, None, True),
                                           (120, None, True), (90, "0", False), (90, "1", True)])
def test_pdl_is_wanted_where_the_cubin_waits(monkeypatch, arch, env, want):
    if env is None:
        monkeypatch.delenv("KVCANARY_PDL", raising=False)
    else:
        monkeypatch.setenv("KVCANARY_PDL", env)
    assert devices.pdl_wanted(arch) is want


@pytest.mark.parametrize("env,major,want", [(None, 9, True), ("0", 9, False), (None, 8, False)])
def test_manager_launches_ask_for_pdl_where_wanted(monkeypatch, fake, env, major, want):
    """Every launch of a K + V manager step (plan, writes, verifies, the pump's snapshot) asks for
    programmatic stream serialization on an sm_90 device, and none does on sm_80 or with
    KVCANARY_PDL=0."""
    if major * 10 not in nvrtc_program.supported_archs():
        pytest.skip(f"this NVRTC cannot target sm_{major}0")
    if env is None:
        monkeypatch.delenv("KVCANARY_PDL", raising=False)
    else:
        monkeypatch.setenv("KVCANARY_PDL", env)
    plain = fake.cuDeviceGetAttribute
    MAJOR = fake_cuda.real.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
    monkeypatch.setattr(fake, "cuDeviceGetAttribute",
                        lambda a, dev: (fake_cuda.OK, major) if a == MAJOR else plain(a, dev))
    assert devices.runtime(0).pdl is want
    _, batch, _ = make_canary()
    canary = manager.KvCanary(manager.PoolGroup(64), device=0, hash_mode="none", max_batch=2, verify_capacity=256)
    s = stream(fake)
    step(canary, batch, s)
    n0 = len(fake.pdl)
    step(canary, batch, s)
    # the snapshot taken by TAIL's last verify
    assert fake.launched[-5:] == ["kvc_prepare", "kvc_write_pair", "kvc_fused_verify_pair", "kvc_write_pair",
                                  "kvc_fused_verify_pair"]
    assert fake.pdl[n0:] == [want] * 5
    fake.run()
    canary.flush()
    canary.health_check()


def test_many_source_verifies_launch_plain_and_the_rest_with_pdl(fake):
    """abi.PLAIN_KERNELS (the many-source verifies) never ask for PDL; the step's other launches do."""
    from kvcanary.runtime import memory
    assert devices.runtime(0).pdl
    pool = memory.zeros((64, 1024), np.uint8)
    sources = [kc.RealKvSource(pool, 1, 1024, 1024) for _ in range(abi.MANY_SOURCES)]
    canary = manager.KvCanary(manager.PoolGroup(64, k_sources=sources, v_sources=sources), device=0,
                              hash_mode="partial", max_batch=2, verify_capacity=256)
    _, batch, _ = make_canary()
    s = stream(fake)
    step(canary, batch, s)
    n0 = len(fake.pdl)
    step(canary, batch, s)
    asked = dict(zip(fake.launched[-5:], fake.pdl[n0:]))
    assert "kvc_fused_verify_many_pair" in asked and asked.pop("kvc_fused_verify_many_pair") is False
    assert set(abi.PLAIN_KERNELS) <= set(abi.KERNELS)
    assert asked and all(asked.values()), asked


def test_a_canary_step_given_no_stream_runs_on_the_stream_its_batch_was_staged_on(fake):
    """A VllmBatchStager's Batch names the stream it was staged on; a canary step given no stream
    launches there, after the staging (on another stream it could read the buffers before they are
    written)."""
    from kvcanary.adapters import VllmBatchStager
    from kvcanary.runtime import memory
    D = memory.to_device
    stager = VllmBatchStager(max_reqs=2, max_tokens=2, max_len=8, block_size=4)
    canary = manager.KvCanary(manager.PoolGroup(64, halves=("K",)), device=0, hash_mode="none", max_batch=2,
                              verify_capacity=64)
    meta = dict(block_table=D(np.array([[1, 2], [3, 4]], np.int32)), seq_lens=D(np.array([3, 2], np.int32)),
                query_start_loc=D(np.array([0, 1, 2], np.int32)), slot_mapping=D(np.array([6, 13], np.int64)),
                input_ids=D(np.array([5, 6], np.int32)), positions=D(np.array([2, 1], np.int64)))
    for s in (stream(fake), stream(fake)):
        n0 = len(fake.streams)
        batch = stager(**meta, stream=s)
        canary.before_forward(batch)
        canary.after_forward(batch)
        assert fake.launched[n0] == "kvc_stage_vllm" and set(fake.streams[n0:]) == {s}, fake.streams[n0:]
    fake.run()


class _Runtime:
    """Enough of a DeviceRuntime for Launch objects that are only inspected, never launched."""

    def launcher(self, name, grid, block, address, grid_y=1):
        return lambda stream: None


@pytest.mark.parametrize("plan_tokens,write_tokens,want", [
    (32, 32, "kvc_prepare_write_pair_warps"),
    (40, 40, "kvc_prepare_write_pair"),
    (0, 40, "kvc_prepare_write_pair"),  # a plan built without out_cache_loc counts no tokens
    (0, abi.FOLD_MAX_TOKENS + 1, None),
])
def test_the_fold_picks_its_kernel_by_the_writes_token_count(plan_tokens, write_tokens, want):
    """The warps-only fold stamps at most 32 tokens a request (one lane each): it must not be picked
    for writes of more tokens, whatever the plan's count says."""
    rt = _Runtime()
    q = abi.PrepareParams()
    q.batch_size, q.num_tokens = 2, plan_tokens
    w = abi.WritePair()
    w.half[0].num_tokens = w.half[1].num_tokens = write_tokens
    plan = launch.Launch(rt, "kvc_prepare", 1, abi.PREPARE_THREADS, q, 0)
    writes = launch.Launch(rt, "kvc_write_pair", 2, abi.BLOCK_THREADS, w, 0, grid_y=abi.HALVES)
    one = launch.folded(plan, writes)
    assert (one and one.name) == want
