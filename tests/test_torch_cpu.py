"""torch CPU tensors on the reference backend (attribute access, no torch import in kvcanary)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import kvcanary as kc
from kvcanary import abi
from tests.support import workloads

torch = pytest.importorskip("torch")


def test_import_kvcanary_does_not_import_torch():
    out = subprocess.run([sys.executable, "-c", "import sys, kvcanary; print('torch' in sys.modules)"],
                         capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


def test_torch_cpu_tensors_equal_numpy():
    w = workloads.make(41, mode=abi.HashMode.ALL, num_sources=2)
    host = lambda a: a  # noqa: E731
    to_torch = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    back = lambda a: a.numpy() if hasattr(a, "numpy") else np.asarray(a)  # noqa: E731
    workloads.assert_same(workloads.run(w, host, back), workloads.run(w, to_torch, back))


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "bfloat16", "int8", "float16"])
def test_any_kv_dtype_is_fingerprinted_as_bytes(dtype):
    raw = np.random.default_rng(2).integers(0, 256, (128, 4, 32), dtype=np.uint8)
    t = torch.from_numpy(raw.copy()).view(getattr(torch, dtype))
    src_t, src_n = kc.source_from_slots(t), kc.source_from_slots(raw)
    assert src_t.num_bytes_per_token == src_n.num_bytes_per_token == 128
    from kvcanary.ops.sources import marshal_sources
    from kvcanary.reference.canary import RefSource, fingerprint
    (mt,), (mn,) = marshal_sources([src_t], abi.HashMode.ALL, 128), marshal_sources([src_n], abi.HashMode.ALL, 128)
    assert mt.view.ptr == t.data_ptr()  # no copy: the live pool is read
    slots = np.arange(128)
    f = lambda m: fingerprint(slots, [RefSource(m.view.host, m.page_size, m.bytes_per_token, m.hash_bytes)])  # noqa: E731
    np.testing.assert_array_equal(f(mt), f(mn))
