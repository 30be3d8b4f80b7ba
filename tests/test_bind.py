"""Declare -> bind -> execute (issue 30): binding an op validates it and fills its params without
touching a backend; only a backend runs it; the stages, the eager ops and the monitor never ask
which backend they have. On tests/support/fake_cuda.py (device arrays) and numpy (host arrays)."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

import kvcanary as kc
from kvcanary import abi
from kvcanary.ops import backends, bind
from kvcanary.runtime import devices, memory

ROOT = Path(__file__).resolve().parent.parent / "kvcanary"


def _state(device):
    ctx = kc.VerifyContext(kc.CanaryBuffer.allocate(64, device=device), kc.ViolationSink.allocate(16, device=device))
    plan = kc.StepPlan.allocate(4, 64, device=device)
    put = (lambda a: a) if device is None else (lambda a: memory.to_device(a, device))
    rtt = np.zeros((2, 8), np.int32)
    rtt[1, 0] = 9  # request row 1: one new token (position 0) in slot 9, nothing cached
    batch = kc.Batch(put(np.array([1], np.int64)), put(np.array([0], np.int64)), put(np.array([1], np.int64)),
                     put(rtt), put(np.array([7], np.int64)), put(np.array([0], np.int64)), put(np.array([9], np.int64)))
    return ctx, plan, batch


def test_binding_fills_the_params_and_touches_no_driver(fake, monkeypatch):
    ctx, plan, batch = _state(0)

    def refused(*a, **k):
        raise AssertionError("bind must not reach the driver")
    monkeypatch.setattr(devices, "runtime", refused)
    (prep,) = bind.bind_build_plan(batch, plan, ctx=ctx)
    fused = bind.bind_fused_verify(ctx, batch, plan)
    write = bind.bind_write(ctx, plan, batch.input_ids, batch.positions, batch.out_cache_loc)
    assert prep.params.req_to_token == batch.req_to_token.ptr and prep.params.batch_size == 1
    assert fused.params.canary == ctx.buffer.view.ptr and fused.params.req_pool_indices == batch.req_pool_indices.ptr
    assert write.params.input_ids == batch.input_ids.ptr and write.params.num_tokens == 1
    assert {b.device for b in (prep, fused, write)} == {0}


def test_the_device_backend_packs_a_bound_op_with_the_kernel_and_grid_its_shape_names(fake):
    ctx, plan, batch = _state(0)
    s = fake.cuStreamCreate(0)[1]
    bound = bind.bind_fused_verify(ctx, batch, plan)
    (launch,) = backends.executor(0).prepare([bound], s)
    name, grid, block = bound.shape(devices.runtime(0))
    assert (launch.name, launch.grid, launch.block, launch.stream) == (name, grid, block, s)
    assert bytes(launch.params) == bytes(bound.params)
    fake.launched.clear()
    launch()
    assert fake.launched == ["kvc_fused_verify"]


def test_the_host_backend_runs_the_reference_and_leaves_nothing_to_replay():
    ctx, plan, batch = _state(None)
    bound = bind.bind_build_plan(batch, plan, ctx=ctx)
    assert plan.num_valid_reqs[0] == 0
    assert backends.executor(None).prepare(bound, None) == []
    assert plan.num_valid_reqs[0] == 1 and plan.offsets[1] == 1  # the reference filled the write plan


def test_host_values_are_checked_when_the_reference_runs_not_when_bound():
    ctx, plan, batch = _state(None)
    batch.req_pool_indices[0] = 5  # a row outside req_to_token (2 rows): a host batch is refused
    bound = bind.bind_fused_verify(ctx, batch, plan)  # binding reads no element
    with pytest.raises(kc.ValidationError, match="req_pool_indices"):
        backends.executor(None).prepare([bound], None)
    assert ctx.sink.kernel_run_view.host[0] == 0  # refused before anything ran


def _asks_for_the_backend(path: Path) -> list[str]:
    """``x.device is None`` / ``is not None`` tests and backend type checks in a module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and node.left.attr == "device" \
                and any(isinstance(c, ast.Constant) and c.value is None for c in node.comparators):
            found.append(f"{path.name}:{node.lineno}")
        if isinstance(node, ast.Name) and node.id in ("HostBackend", "CudaBackend"):
            found.append(f"{path.name}:{node.lineno} names {node.id}")
    return found


@pytest.mark.parametrize("module", ["ops/__init__.py", "ops/bind.py", "manager/stages.py", "manager/canary.py",
                                    "reporting/monitor.py"])
def test_only_the_backends_know_which_backend_runs(module):
    assert _asks_for_the_backend(ROOT / module) == []


def test_the_backend_check_finds_what_it_looks_for(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f(ctx):\n    if ctx.device is None:\n        return HostBackend()\n")
    assert _asks_for_the_backend(probe) == ["probe.py:2", "probe.py:3 names HostBackend"]


def test_a_stage_pairs_its_halves_on_the_device_and_runs_them_in_order_on_the_host(fake):
    group = kc.PoolGroup(64)  # K and V halves
    dev = kc.KvCanary(group, device=0, hash_mode="none", max_batch=2, verify_capacity=64)
    _, _, batch = _state(0)
    s = fake.cuStreamCreate(0)[1]
    fake.launched.clear()
    dev.before_forward(batch, stream=s)
    assert fake.launched == ["kvc_prepare", "kvc_write_pair", "kvc_fused_verify_pair"]
    host = kc.KvCanary(group, hash_mode="none", max_batch=2, verify_capacity=64)
    _, _, hbatch = _state(None)
    host.before_forward(hbatch)
    host.after_forward(hbatch)
    assert host.stats()["violations"] == 0 and host.launches_per_step() == 0
    assert abi.PAIRED["kvc_write"] == "kvc_write_pair"
