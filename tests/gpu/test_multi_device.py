"""GPU tier, two or more devices: each device gets its own runtime; results equal the reference."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvcanary import driver, memory
from tests import workloads

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
        assert driver.runtime(d).ordinal == d
