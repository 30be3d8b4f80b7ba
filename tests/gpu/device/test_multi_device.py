"""GPU tier, two or more devices: each device gets its own runtime; results equal the reference."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvcanary.runtime import devices, driver, memory
from tests.support import workloads

pytestmark = pytest.mark.gpu


def test_workloads_on_every_device_from_threads():
    n = driver.device_count()
    if n < 2:
        pytest.skip("needs two CUDA devices")
    ws = [workloads.make(200 + d) for d in range(n)]
    refs = [workloads.run(w, lambda a: a, np.asarray) for w in ws]
    out = [None] * n

    def work(d):
        to = lambda a: memory.to_device(np.ascontiguousarray(a), d)  # noqa: E731
        out[d] = workloads.run(ws[d], to, lambda a: a.numpy() if hasattr(a, "numpy") else np.asarray(a))

    threads = [threading.Thread(target=work, args=(d,)) for d in range(n)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    for d in range(n):
        workloads.assert_same(refs[d], out[d])
        assert devices.runtime(d).ordinal == d


@pytest.mark.parametrize("fault", [None, "kv"])
def test_manager_on_the_last_device_equals_reference(fault):
    """The step API, the snapshot pump (mapped pinned memory written by a kernel of that device)
    and the report path on a device other than 0."""
    from tests.support.session import Session
    from tests.support.session import host_buffers as buffers
    from tests.support.session import violation_key as key
    from tests.test_manager import _flip_kv
    n = driver.device_count()
    if n < 2:
        pytest.skip("needs two CUDA devices")
    at, corrupt = (4, _flip_kv) if fault else (None, None)
    host = Session(swa=True, chain_position_assert=True)
    dev = Session(n - 1, swa=True, chain_position_assert=True)
    want = key(host.script(at, corrupt))
    assert key(dev.script(at, corrupt)) == want
    assert (len(want) > 0) == bool(fault)
    hb, db = buffers(host.canary), buffers(dev.canary)
    for name in hb:
        np.testing.assert_array_equal(hb[name], db[name], err_msg=str(name))
    dev.canary.health_check()
