"""ABI single source: ctypes layouts, the generated prelude and its compile-time layout checks."""

from __future__ import annotations

import ctypes
import re

import pytest

from kvcanary import abi
from kvcanary.errors import CompileError
from kvcanary.runtime import nvrtc_build as kc_compile
from tests.support.cubin import entry_points


@pytest.mark.parametrize("decl", abi.STRUCTS, ids=lambda d: d.name)
def test_ctypes_sizes_and_offsets_match_the_tables(decl):
    ct = abi.CTYPES[decl.name]
    assert ctypes.sizeof(ct) == abi.struct_size(decl)
    for name, off in abi.layout(decl).items():
        assert getattr(ct, name).offset == off, name


def test_spec_constants():
    assert abi.ANCHOR == 0xC0FFEE1234567890 and abi.SLOT_BYTES == 32 and abi.RING_COLS == 8
    assert [int(b) for b in abi.FailReason][:6] == [1, 2, 4, 8, 16, 32]
    assert [t.name for t in abi.LaunchTag][:4] == ["HEAD_K_FULL", "HEAD_V_FULL", "TAIL_K_FULL", "TAIL_V_FULL"]
    assert abi.LaunchTag.SWEEP_V_SWA == 11 and abi.MAX_REAL_KV_SOURCES == 64
    assert (abi.COL_KERNEL_KIND, abi.COL_FAIL_REASON_BITS) == (0, 7)


def test_prelude_defines_every_constant_and_struct():
    text = abi.render_prelude()
    for name, value in abi.constants().items():
        if value == -(1 << 63):  # C has no literal for INT64_MIN
            assert f"#define {name} ((long long)(-9223372036854775807LL - 1))" in text, name
            continue
        if name in abi.PREPROCESSOR_CONSTANTS:  # compared by #if, which takes no casts
            assert re.search(rf"^#define {name} {value}$", text, re.M), name
            continue
        assert re.search(rf"#define {name} \(\([a-z ]+\){value}(ULL|LL)\)", text), name
    for decl in abi.STRUCTS:
        assert f"struct {decl.name} {{" in text
        assert f"sizeof({decl.name}) == {abi.struct_size(decl)}" in text
    assert "unsigned long long ptr" not in text  # pointers keep their C types
    assert "const long long* plan_slot;" in text


def test_kernel_table_names_existing_structs():
    names = {d.name for d in abi.STRUCTS}
    assert set(abi.KERNELS.values()) <= names
    sources = kc_compile.read_sources()
    assert sorted(f.source for f in abi.FAMILIES) == sorted(n for n in sources if n.endswith(".cu"))
    for family in abi.FAMILIES:  # each kernel is defined in its own family's file
        for kernel in family.kernels:
            if not kernel.startswith("kvc_echo_"):
                assert re.search(rf"\b{kernel}\(", sources[family.source]), (family.name, kernel)


def test_snapshot_kernel_is_declared_like_the_others():
    """The pump's kvc_snapshot takes a struct that the prelude asserts and the GPU echo probe covers
    (the parametrised layout, compile and echo tests pick it up from these tables); it is declared
    before the verify structs, which hold one for the snapshot a step's last launch takes."""
    assert abi.KERNELS["kvc_snapshot"] == "KvcSnapshotParams"
    assert abi.STRUCTS.index(abi.SNAPSHOT_PARAMS) < abi.STRUCTS.index(abi.VERIFY_PARAMS)
    assert abi.SNAPSHOT_PARAMS in abi.PARAMS_STRUCTS
    assert abi.KERNELS["kvc_echo_KvcSnapshotParams"] == "KvcSnapshotParams"
    assert abi.layout(abi.SNAPSHOT_PARAMS) == {"status": 0, "payload": 8, "done": 16, "n": 24, "ticket": 32, "head": 40,
                                               "arrive": 48}
    text = abi.render_prelude()
    assert "sizeof(KvcSnapshotParams) == 56" in text and "offset of KvcSnapshotParams.ticket" in text
    assert "X(KvcSnapshotParams)" in text
    for decl in (abi.VERIFY_PARAMS, abi.FUSED_VERIFY_PARAMS):  # the last field: appended to the verify tail
        assert decl.fields[-1] == abi.Field("snap", "struct:KvcSnapshotParams", 1)


def test_no_kvcanary_number_typed_into_kernel_sources():
    """Hash constants, bit values and the anchor come from the prelude, never from .cu text."""
    text = "\n".join(kc_compile.read_sources().values()).lower()
    for value in (abi.ANCHOR, abi.SM_MUL1, abi.SM_MUL2):
        assert f"{value:x}" not in text
    assert "0xc0ffee" not in text


def test_misaligned_field_is_rejected_in_python():
    bad = abi.StructDecl("Bad", (abi.Field("a", "i32"), abi.Field("b", "i64")))
    with pytest.raises(AssertionError, match="misaligned"):
        abi.layout(bad)


@pytest.mark.parametrize("arch", kc_compile.SUPPORTED_ARCHS)
def test_each_family_compiles_to_exactly_its_kernels_for_every_supported_arch(arch):
    """Each family's program exports exactly the kernels its abi.FAMILIES entry declares (a name
    typed in the table but not in its .cu, an extern "C" kernel the table lacks, or a kernel in
    another family's file fails here, on the CPU, not when a cubin loads on a device)."""
    sources, prelude = kc_compile.read_sources(), abi.render_prelude()
    for family in abi.FAMILIES:
        cubin = kc_compile.compile_family(family, sources, prelude, arch)
        assert entry_points(cubin) == set(family.kernels), family.name
    # A clean compile has a 1-byte log: writing it must not touch CPython's shared b" ".
    assert b" "[0] == 32 and " ".join(["str", "tag"]) == "str tag"


def test_a_renamed_kernel_is_an_entry_point_abi_does_not_declare():
    sources = dict(kc_compile.read_sources())
    sources["pump.cu"] = sources["pump.cu"].replace("void kvc_snapshot(", "void kvc_snapshot_v2(")
    pump = abi.family_of("kvc_snapshot")
    got = entry_points(kc_compile.compile_family(pump, sources, abi.render_prelude(), 90))
    assert got ^ set(pump.kernels) == {"kvc_snapshot", "kvc_snapshot_v2"}


def test_a_family_reads_its_own_file_and_the_headers_only():
    sources = kc_compile.read_sources()
    got = kc_compile.family_sources(abi.family_of("kvc_write"), sources)
    assert sorted(got) == ["common.cuh", "fingerprint.cuh", "plan.cuh", "write.cu"]
    with pytest.raises(CompileError, match=r"kernel family write expects kernels_src/write.cu, got only \['plan.cu'\]"):
        kc_compile.family_sources(abi.family_of("kvc_write"), {"plan.cu": "", "common.cuh": ""})


def test_layout_drift_fails_the_compile_with_the_static_assert():
    offsets = {d.name: abi.layout(d) for d in abi.STRUCTS}
    offsets["KvcVerifyParams"] = dict(offsets["KvcVerifyParams"], plan_capacity=offsets["KvcVerifyParams"]["plan_capacity"] + 8)
    with pytest.raises(CompileError) as err:  # any family: each program includes the prelude
        kc_compile.compile_family(abi.family_of("kvc_snapshot"), kc_compile.read_sources(),
                                  abi.render_prelude(offsets=offsets), 90)
    assert "offset of KvcVerifyParams.plan_capacity differs from abi.py" in str(err.value)
    assert "--gpu-architecture=sm_90" in str(err.value)  # the error carries the options


def test_compile_error_carries_log_and_numbered_source():
    sources = dict(kc_compile.read_sources())
    assert "p.plan_num_valid" in sources["verify.cu"]
    sources["verify.cu"] = sources["verify.cu"].replace("p.plan_num_valid", "p.no_such_field")
    with pytest.raises(CompileError) as err:
        kc_compile.compile_family(abi.family_of("kvc_verify"), sources, abi.render_prelude(), 80)
    text = str(err.value)
    assert text.startswith("kv-canary: NVRTC could not compile kvcanary_verify.cu for sm_80")
    assert "no_such_field" in text and "--- source ---" in text and "// ===== verify.cu" in text
    assert re.search(r"^\s+\d+  ", text, re.M)  # numbered lines
