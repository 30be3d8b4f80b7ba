"""CPU tier: the benchmark suite's own kernels (perf/kernels: the bound probes and the SGLang-shaped
baseline, and the tuning benchmark's verify.cu variants) compile with NVRTC, so a broken probe or
variant fails here, on a machine without a GPU, not first on the benchmark machine. (They live in
tests/ because the test command collects tests/ only.)"""

from __future__ import annotations

import pytest

from kvcanary.runtime.nvrtc_build import SUPPORTED_ARCHS
from kvcanary.runtime.nvrtc_program import supported_archs
from perf.bounds import PROBE_NAMES, compile_probes, probe_sources
from perf.test_tuning import BLOCKS_PER_SM, TILE_ENTRIES, variant_cubin


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
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


@pytest.mark.parametrize("vt,blocks", [(min(TILE_ENTRIES), min(BLOCKS_PER_SM)), (max(TILE_ENTRIES), max(BLOCKS_PER_SM))])
def test_tuning_variants_compile(vt, blocks):
    """The tuning benchmark's verify.cu variants (the swept tile depth and occupancy at their
    extremes) compile for sm_90, so a kernel change that breaks them (e.g. shared memory sized by
    the tile depth) fails here rather than in the GPU session."""
    if 90 not in supported_archs():
        pytest.skip("this NVRTC cannot target sm_90")
    cubin = variant_cubin(90, vt, blocks)
    assert cubin[:4] == b"\x7fELF" and b"kvc_fused_verify" in cubin
