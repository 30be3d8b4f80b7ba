"""CPU tier of the suite: the bound probes compile with NVRTC for every arch kvcanary targets,
so a broken probe fails here, on a machine without a GPU, not first on the benchmark machine."""

from __future__ import annotations

import pytest

from kvcanary.compile import DEFAULT_ARCHS, supported_archs

from .bounds import PROBE_NAMES, compile_probes, probe_sources


@pytest.mark.parametrize("arch", DEFAULT_ARCHS)
def test_probes_compile(arch):
    if arch not in supported_archs():
        pytest.skip(f"this NVRTC cannot target sm_{arch}")
    cubin = compile_probes(arch)
    assert cubin[:4] == b"\x7fELF", "NVRTC returned something other than a cubin"
    for name in PROBE_NAMES:
        assert name.encode() in cubin, f"kernel {name} missing from the sm_{arch} cubin"


def test_probes_use_the_kernels_hashing():
    """The serial-chain probe must time kvcanary's own kvc_mix3, not a copy of it."""
    sources = probe_sources()
    assert '#include "common.cuh"' in sources["probes.cu"]
    assert "kvc_mix3" in sources["common.cuh"] and "kvc_mix3(" in sources["probes.cu"]
    assert "__device__ __forceinline__ uint64_t kvc_mix3" not in sources["probes.cu"]
