"""Kernel families (abi.FAMILIES): each kernel name declared once, each family its own NVRTC program
and its own CUlibrary; the core families load when a device's runtime is created, stage and probe
on their first use, once, with their kernels' parameter sizes checked. Without a GPU: the fake
driver of tests/support/fake_cuda.py, whose libraries export their cubin's real entry points."""

from __future__ import annotations

import io
import threading
import time

import pytest

import kvcanary
from kvcanary import abi
from kvcanary.runtime import devices, driver
from kvcanary.errors import DriverError
from tests.support import fake_cuda
from tests.support.cubin import entry_points

CORE = [f.name for f in abi.CORE_FAMILIES]
LAZY = {k for f in abi.FAMILIES if not f.core for k in f.kernels}


def test_the_kernel_tables_are_derived_from_the_families():
    assert [f.name for f in abi.FAMILIES] == ["plan", "verify", "write", "records", "pump", "stage", "probe"]
    assert CORE == ["plan", "verify", "write", "records", "pump"]
    assert abi.KERNELS == {k: s for f in abi.FAMILIES for k, s in f.kernels.items()}
    assert abi.PAIRED == {"kvc_write": "kvc_write_pair", "kvc_fused_verify": "kvc_fused_verify_pair",
                          "kvc_fused_verify_wide": "kvc_fused_verify_wide_pair",
                          "kvc_fused_verify_many": "kvc_fused_verify_many_pair"}
    assert abi.PLAIN_KERNELS == {"kvc_verify_many", "kvc_fused_verify_many", "kvc_fused_verify_many_pair"}
    assert {"kvc_stage_vllm", "kvc_stage_paged", "kvc_empty", "kvc_abi_layout"} <= LAZY
    assert abi.family_of("kvc_fused_verify_pair").source == "verify.cu"
    assert abi.family_of("kvc_echo_buffer").name == "probe"  # a variable the host looks up
    with pytest.raises(KeyError, match=r"no kernel family declares 'kvc_nope'.*Fix: add it"):
        abi.family_of("kvc_nope")


def test_a_family_must_declare_what_it_pairs_or_launches_plain():
    with pytest.raises(AssertionError, match=r"family f pairs or launches plain \['k_pair'\].*Fix"):
        abi.KernelFamily("f", "f.cu", {"k": "KvcProbeParams"}, paired={"k": "k_pair"})


def test_a_name_declared_by_two_families_is_refused():
    twice = (abi.FAMILIES[0], abi.KernelFamily("again", "again.cu", {"kvc_prepare": "KvcPrepareParams"}))
    with pytest.raises(AssertionError, match="declared by two families"):
        abi.index_families(twice)


def test_core_cubins_carry_no_stage_or_probe_kernel():
    """The cubins import compiled: one per family and arch, each exporting its family's kernels
    only, so the adapters' and the probe's kernels are in no core family's cubin."""
    for arch, cubins in kvcanary.COMPILED.cubins.items():
        assert set(cubins) == {f.name for f in abi.FAMILIES}, arch
        for family in abi.FAMILIES:
            assert entry_points(cubins[family.name]) == set(family.kernels), (arch, family.name)
        assert not {k for f in abi.CORE_FAMILIES for k in entry_points(cubins[f.name])} & LAZY


def test_a_runtime_loads_the_core_families_and_a_lazy_family_once_on_first_use(fake):
    rt = devices.runtime(0)
    assert fake.library_loads == CORE and list(rt.libraries) == CORE
    assert "kvc_stage_vllm" not in rt.functions and "kvc_empty" not in rt.functions
    assert rt.functions["kvc_empty"] == "kvc_empty"  # the first lookup loads the probe family
    assert fake.library_loads == [*CORE, "probe"]
    p = abi.ProbeParams()
    rt.launch_struct("kvc_abi_layout", 1, 32, p, driver.PER_THREAD_STREAM)
    fake.globals["kvc_echo_buffer"] = (0x5000, abi.ECHO_BYTES)
    assert rt.global_address("kvc_echo_buffer") == (0x5000, abi.ECHO_BYTES)
    assert fake.library_loads == [*CORE, "probe"] and fake.launched == ["kvc_abi_layout"]
    assert rt.resident_blocks("kvc_stage_paged", abi.BLOCK_THREADS) > 0  # stage, on its first use
    rt.launcher("kvc_stage_vllm", 1, abi.BLOCK_THREADS, 0)
    assert fake.library_loads == [*CORE, "probe", "stage"] and list(rt.libraries) == [*CORE, "probe", "stage"]
    with pytest.raises(KeyError, match="no kernel family declares 'kvc_nope'"):
        rt.functions["kvc_nope"]


def test_a_variable_loads_its_family_first(fake):
    rt = devices.runtime(0)
    fake.globals["kvc_echo_buffer"] = (0x5000, abi.ECHO_BYTES)
    assert rt.global_address("kvc_echo_buffer") == (0x5000, abi.ECHO_BYTES)
    assert fake.library_loads == [*CORE, "probe"] and "kvc_abi_layout" in rt.functions


def test_concurrent_first_uses_load_a_lazy_family_once(fake, monkeypatch):
    rt = devices.runtime(0)
    load = fake.cuLibraryLoadData

    def slow_load(*args):  # widen the race: every thread asks while the first load runs
        time.sleep(0.05)
        return load(*args)
    monkeypatch.setattr(fake, "cuLibraryLoadData", slow_load)
    got, start = [], threading.Barrier(8)

    def first_use(name):
        start.wait()
        got.append(rt.functions[name])
    threads = [threading.Thread(target=first_use, args=(n,)) for n in ["kvc_empty", "kvc_abi_layout"] * 4]
    [t.start() for t in threads]
    [t.join(10) for t in threads]
    assert sorted(got) == ["kvc_abi_layout"] * 4 + ["kvc_empty"] * 4
    assert fake.library_loads == [*CORE, "probe"]


def test_a_lazy_familys_parameter_sizes_are_checked_at_its_first_use(fake, monkeypatch):
    """A stage kernel whose cubin disagrees with abi.py is refused when the family loads, and the
    family stays unloaded (the next use fails the same way, never launches a mismatched kernel)."""
    info = fake.cuKernelGetParamInfo
    monkeypatch.setattr(fake, "cuKernelGetParamInfo",
                        lambda k, i: (fake_cuda.OK, 0, 8) if (k, i) == ("kvc_stage_vllm", 0) else info(k, i))
    rt = devices.runtime(0)  # stage is not loaded yet: creating the runtime works
    for _ in range(2):
        with pytest.raises(DriverError, match=r"load of kernel kvc_stage_vllm failed with ABI_MISMATCH; expected "
                                              r"one parameter of \d+ bytes"):
            rt.functions["kvc_stage_vllm"]
    assert "stage" not in rt.libraries and "kvc_stage_paged" not in rt.functions


def test_a_kernel_asked_of_another_familys_library_is_not_found(fake):
    """The fake is as strict as the driver: a family's library has only its own kernels."""
    rt = devices.runtime(0)
    err, _ = fake.cuLibraryGetKernel(rt.libraries["verify"], b"kvc_write")
    assert err == fake_cuda.NOT_FOUND


def test_the_doctor_reports_each_familys_cubin_and_loads_the_probe_on_use(fake, monkeypatch):
    from kvcanary.cli import doctor
    monkeypatch.setattr(fake, "cuDriverGetVersion", lambda: (fake_cuda.OK, 13000), raising=False)
    out = io.StringIO()
    doctor.run(out)
    text = out.getvalue()
    for arch, cubins in kvcanary.COMPILED.cubins.items():
        sizes = ", ".join(f"{f.name} {len(cubins[f.name]) / 1024:.0f} KB" for f in abi.FAMILIES)
        assert f"cubins sm_{arch}           {sizes}\n" in text, text
    assert "GPU 0                  sm_90, 132 SMs, cubin sm_90" in text, text
    assert fake.library_loads == [*CORE, "probe"]  # its launch round-trip loaded the probe family


def test_a_device_outside_the_configured_archs_compiles_its_core_families_then_each_lazy_one_on_use(
        fake, monkeypatch):
    """An sm_100 device (imports compiled 80 and 90): its core families compile when its runtime
    is created, the probe family only at its first use, each once."""
    from kvcanary.runtime import nvrtc_build
    attrs = fake_cuda.real.CUdevice_attribute
    capability = {attrs.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: 10,
                  attrs.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: 0}
    monkeypatch.setattr(fake, "cuDeviceGetAttribute", lambda attr, dev: (fake_cuda.OK, capability.get(attr, 148)))
    asked, sm90 = [], kvcanary.COMPILED.cubins[90]  # the fake reads only the cubins' symbols

    def load_kernels(archs, families):
        asked.append((archs, [f.name for f in families]))
        return nvrtc_build.CompiledKernels({100: {f.name: sm90[f.name] for f in families}}, "wheel x", None, 0, 0)
    monkeypatch.setattr(nvrtc_build, "load_kernels", load_kernels)
    rt = devices.runtime(0)
    assert rt.arch == 100 and asked == [((100,), CORE)] and fake.library_loads == CORE
    assert rt.functions["kvc_empty"] == "kvc_empty" and rt.functions["kvc_abi_layout"] == "kvc_abi_layout"
    assert asked == [((100,), CORE), ((100,), ["probe"])] and fake.library_loads == [*CORE, "probe"]


def test_a_stager_loads_the_stage_family_when_built_not_at_its_first_step(fake):
    """The adapters' stagers are built outside any stream capture (they allocate their buffers);
    their first step may be captured into a graph, so the stage family loads at construction."""
    from kvcanary.adapters import PagedBatchStager, VllmBatchStager
    VllmBatchStager(max_reqs=2, max_tokens=2, max_len=8, block_size=4)
    assert fake.library_loads == [*CORE, "stage"]
    assert "kvc_stage_paged" in devices.runtime(0).functions and PagedBatchStager.KERNEL == "kvc_stage_paged"

