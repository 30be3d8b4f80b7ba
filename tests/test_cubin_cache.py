"""Compile cache: keys name every input, atomic writes, corrupt entries are misses, fallbacks."""

from __future__ import annotations

import ast
import os
import re
import stat
import subprocess
import sys
import warnings

import pytest

import kvcanary as kc

from kvcanary import abi
from kvcanary.runtime import cubin_cache as kcache
from kvcanary.runtime import nvrtc_build as kc_compile
from kvcanary.runtime import nvrtc_program
from kvcanary.runtime import parallel_compile as kc_parallel

BASE = dict(schema="s", kvcanary="0.1", nvrtc=(13, 0), arch=90, options=("-a",), prelude=b"p", sources=(("a.cu", b"x"),))


@pytest.mark.parametrize("field,value", [("schema", "t"), ("kvcanary", "0.2"), ("nvrtc", (13, 1)), ("arch", 80),
                                         ("options", ("-b",)), ("prelude", b"q"), ("sources", (("a.cu", b"y"),))])
def test_key_changes_with_each_input(field, value):
    assert kcache.cache_key(**BASE) != kcache.cache_key(**dict(BASE, **{field: value}))
    assert len(kcache.cache_key(**BASE)) == 64


def test_roundtrip_and_atomic_write(tmp_path):
    c = kcache.CubinCache(tmp_path)
    c.put("k" * 64, b"cubin-bytes")
    assert [p.name for p in tmp_path.iterdir()] == ["k" * 64 + ".cubin"]  # no temp files left behind
    fresh = kcache.CubinCache(tmp_path)
    assert fresh.get("k" * 64) == b"cubin-bytes" and fresh.hits == 1


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty", "garbage"])
def test_corrupt_entry_is_a_miss(tmp_path, damage):
    kcache.CubinCache(tmp_path).put("a" * 64, b"x" * 1000)
    path = tmp_path / ("a" * 64 + ".cubin")
    blob = path.read_bytes()
    path.write_bytes({"truncate": blob[:-10], "flip": blob[:-1] + bytes([blob[-1] ^ 1]), "empty": b"",
                      "garbage": b"not a cache entry"}[damage])
    c = kcache.CubinCache(tmp_path)
    assert c.get("a" * 64) is None and c.misses == 1


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_dir_falls_back_to_memory_with_one_warning(tmp_path):
    tmp_path.chmod(stat.S_IRUSR | stat.S_IXUSR)
    _check_fallback(tmp_path / "sub")


def test_unwritable_dir_falls_back_to_memory_with_one_warning(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache directory should be")
    _check_fallback(blocker / "cache")


def _check_fallback(directory):
    c = kcache.CubinCache(directory)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c.put("b" * 64, b"one")
        c.put("c" * 64, b"two")
    assert len([w for w in caught if "not writable" in str(w.message)]) == 1
    assert c.get("b" * 64) == b"one" and c.get("c" * 64) == b"two"


def test_env_disables_and_redirects(monkeypatch, tmp_path):
    monkeypatch.setenv("KVCANARY_CACHE", "0")
    assert kcache.default_dir() is None
    monkeypatch.setenv("KVCANARY_CACHE", "1")
    monkeypatch.setenv("KVCANARY_CACHE_DIR", str(tmp_path))
    assert kcache.default_dir() == tmp_path


def test_load_kernels_hits_after_a_miss(tmp_path, capsys):
    c = kcache.CubinCache(tmp_path)
    first = kc_compile.load_kernels((90,), cache=c)
    cold = capsys.readouterr().err
    second = kc_compile.load_kernels((90,), cache=kcache.CubinCache(tmp_path))
    n = len(abi.FAMILIES)  # one cubin per family
    assert (first.misses, second.hits, second.misses) == (n, n, 0) and len(list(tmp_path.iterdir())) == n
    assert first.cubins == second.cubins and set(first.cubins[90]) == {f.name for f in abi.FAMILIES}
    # a cold compile says so on stderr (what, why, how to avoid it), then a line per finished arch;
    # a warm load is silent
    line, progress = cold.splitlines()
    assert re.fullmatch(r"kvcanary: compiled sm_90 \(\d+\.\d s\)", progress), progress
    assert line.startswith("kvcanary: compiling the CUDA kernels with NVRTC for sm_90 (")
    assert str(tmp_path) in line and "KVCANARY_ARCHS" in line and "KVCANARY_CACHE_DIR" in line
    assert capsys.readouterr().err == ""


def test_compile_notice_without_a_disk_cache():
    line = kc_compile.compile_notice((80, 90), None)
    assert "sm_80, sm_90" in line and "KVCANARY_CACHE=0 compiles at every import" in line and "\n" not in line


def test_compiled_kernels_repr_is_short():
    import kvcanary
    c = kvcanary.COMPILED
    text = repr(c)
    assert len(text) < 200 * (1 + len(c.cubins)), len(text)   # never the cubin bytes (megabytes)
    for arch, cubins in c.cubins.items():
        assert f"sm_{arch}: {len(cubins)} families, {sum(map(len, cubins.values())) / 1e6:.2f} MB" in text
    assert f"nvrtc={c.nvrtc!r}" in text and f"hits={c.hits}" in text and "b'" not in text
    fake = kc_compile.CompiledKernels({90: {"verify": b"x" * 2_000_000, "pump": b"x" * 1_000_000}}, "wheel 13.0",
                                      None, 0, 2, keys={(90, "verify"): "ab" * 32, (90, "pump"): "cd" * 32})
    assert repr(fake) == ("CompiledKernels(cubins={sm_90: 2 families, 3.00 MB}, nvrtc='wheel 13.0', cache_dir=None, "
                          "hits=0, misses=2, skipped_archs=(), keys=2)")
    assert fake.sizes(90) == {"verify": 2_000_000, "pump": 1_000_000} and fake.sizes(80) == {}


def _family_keys(sources, prelude, arch=90):
    return {f.name: kc_compile.family_key(f, arch, sources, prelude, "wheel 13.0") for f in abi.FAMILIES}


def test_a_family_key_covers_what_its_program_reads_and_nothing_else():
    """Catches one key over every kernels_src file (an edit anywhere recompiled every kernel):
    an edit of verify.cu changes the verify family's key only; a header or the prelude, every key."""
    sources, prelude = kc_compile.read_sources(), abi.render_prelude()
    base = _family_keys(sources, prelude)
    assert len(set(base.values())) == len(abi.FAMILIES)  # the family name is in the key
    for family in abi.FAMILIES:
        edited = _family_keys(dict(sources, **{family.source: sources[family.source] + "// edited\n"}), prelude)
        assert [n for n in base if edited[n] != base[n]] == [family.name]
    for header in [n for n in sources if n.endswith(".cuh")]:
        edited = _family_keys(dict(sources, **{header: sources[header] + "// edited\n"}), prelude)
        assert all(edited[n] != base[n] for n in base), header
    assert all(k != base[n] for n, k in _family_keys(sources, prelude + "\n").items())
    assert all(k != base[n] for n, k in _family_keys(sources, prelude, arch=80).items())


def test_an_edit_of_verify_cu_recompiles_the_verify_family_only(tmp_path, monkeypatch, capsys):
    compiled = []

    def compile_units(units, programs, prelude):  # records what would compile (NVRTC not run)
        for arch, name in units:
            assert next(f for f in abi.FAMILIES if f.name == name).source in programs[name]
            compiled.append((arch, name))
            yield arch, name, f"cubin of {name}".encode()
    monkeypatch.setattr(kc_parallel, "compile_units", compile_units)
    monkeypatch.setattr(nvrtc_program, "supported_archs", lambda: (80, 90))
    kc_compile.load_kernels((90,), cache=kcache.CubinCache(tmp_path))
    assert sorted(compiled) == sorted((90, f.name) for f in abi.FAMILIES)
    compiled.clear()
    sources = kc_compile.read_sources()
    monkeypatch.setattr(kc_compile, "read_sources", lambda: dict(sources, **{"verify.cu": sources["verify.cu"] + "\n"}))
    again = kc_compile.load_kernels((90,), cache=kcache.CubinCache(tmp_path))
    assert compiled == [(90, "verify")] and (again.hits, again.misses) == (len(abi.FAMILIES) - 1, 1)
    assert again.cubins[90]["pump"] == b"cubin of pump"
    capsys.readouterr()


def test_load_kernels_of_some_families_compiles_and_names_those_only(tmp_path, monkeypatch, capsys):
    """A device of an arch outside the configured list loads a lazy family at its first use: only
    that family compiles, and the notice names it."""
    compiled = []
    monkeypatch.setattr(kc_parallel, "compile_units", lambda units, programs, prelude: [
        compiled.append(u) or (*u, b"x") for u in units])
    monkeypatch.setattr(nvrtc_program, "supported_archs", lambda: (100,))
    got = kc_compile.load_kernels((100,), cache=kcache.CubinCache(tmp_path), families=(abi.family_of("kvc_empty"),))
    assert compiled == [(100, "probe")] and got.cubins == {100: {"probe": b"x"}}
    assert "compiling the CUDA kernels (probe) with NVRTC for sm_100" in capsys.readouterr().err


def test_archs_env(monkeypatch):
    monkeypatch.setenv("KVCANARY_ARCHS", "sm_90, 80")
    assert kc_compile.configured_archs() == (80, 90)
    monkeypatch.setenv("KVCANARY_ARCHS", ",")
    with pytest.raises(ValueError, match=r"must name at least one compute capability, got ','\. Fix: set it to e\.g\."):
        kc_compile.configured_archs()
    monkeypatch.setenv("KVCANARY_ARCHS", "ninety")
    with pytest.raises(ValueError, match=r"kv-canary: KVCANARY_ARCHS.*got 'ninety'\. Fix: set it to your GPUs' archs"):
        kc_compile.configured_archs()


def test_archs_older_than_sm80_are_refused_in_one_line(monkeypatch):
    """Catches KVCANARY_ARCHS=75 reaching NVRTC: the kernels need sm_80 (warp reductions), and the
    compile failed with a 539-line traceback ending in "Fix: correct the source"."""
    monkeypatch.setenv("KVCANARY_ARCHS", "75,90")
    with pytest.raises(kc.ValidationError) as err:
        kc_compile.configured_archs()
    assert str(err.value).count("\n") == 0 and str(err.value).startswith("kv-canary: KVCANARY_ARCHS names sm_75, "
                                                                         "older than sm_80")
    assert "Fix: set only sm_80+ archs" in str(err.value)


def test_a_gpu_older_than_sm80_is_refused_in_one_line_before_any_context(monkeypatch):
    """Catches an sm_75 device (a T4) reaching the compile of its arch at the first launch."""
    from kvcanary.runtime import devices
    from tests.support import fake_cuda
    fake = fake_cuda.install(monkeypatch)
    attrs = fake_cuda.real.CUdevice_attribute
    capability = {attrs.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: 7,
                  attrs.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: 5}
    monkeypatch.setattr(fake, "cuDeviceGetAttribute", lambda attr, dev: (fake_cuda.OK, capability.get(attr, 40)))
    retained = []
    monkeypatch.setattr(fake, "cuDevicePrimaryCtxRetain", lambda dev: retained.append(dev) or (fake_cuda.OK, 0))
    compiled = []
    monkeypatch.setattr(kc_compile, "load_kernels", lambda *a, **k: compiled.append(a))
    with pytest.raises(kc.UnsupportedDeviceError) as err:
        devices.runtime(0)
    assert str(err.value) == ("kv-canary: CUDA device 0 is sm_75, older than sm_80, the oldest GPU kvcanary's kernels "
                              "run on (Ampere: A100, A10, RTX 30xx and newer). Fix: run the canary on an sm_80+ GPU, "
                              "or on the CPU reference backend (KvCanary(device=None) with host arrays)")
    assert retained == [] and compiled == []
    fake_cuda.release(fake)


def test_import_never_calls_cuinit(tmp_path):
    """Import in a fresh interpreter with cuInit (and every other driver entry point) patched."""
    code = (
        "import cuda.bindings.driver as d\n"
        "calls = []\n"
        "for name in dir(d):\n"
        "    obj = getattr(d, name)\n"
        "    if name.startswith('cu') and callable(obj) and not isinstance(obj, type):\n"
        "        setattr(d, name, (lambda n: lambda *a, **k: calls.append(n))(name))\n"
        "import kvcanary\n"
        "assert kvcanary.COMPILED.cubins, 'no cubins'\n"
        "print('driver calls:', calls)\n"
        "assert calls == [], calls\n")
    env = dict(os.environ, KVCANARY_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=os.getcwd())
    assert out.returncode == 0, out.stderr + out.stdout
    assert "driver calls: []" in out.stdout


def test_installed_version_matches_importlib_metadata(tmp_path, monkeypatch):
    from importlib import metadata
    for dist in ("numpy", "nvidia-cuda-nvrtc", "cuda-bindings"):
        try:
            want = metadata.version(dist)
        except metadata.PackageNotFoundError:
            want = None
        assert kc_compile.installed_version(dist) == want, dist
    assert kc_compile.installed_version("kvcanary-no-such-distribution") is None
    # first match on sys.path wins, zip files and missing folders are skipped
    (tmp_path / "Nvidia_Cuda_Nvrtc-99.1.dist-info").mkdir()
    monkeypatch.setattr(sys, "path", [str(tmp_path / "missing"), str(tmp_path / "x.zip"), str(tmp_path), *sys.path])
    assert kc_compile.installed_version("nvidia-cuda-nvrtc") == "99.1"
    assert kc_compile.nvrtc_identity() == "wheel 99.1"


def test_warm_import_loads_neither_importlib_metadata_nor_a_thread_pool(tmp_path):
    # what the interpreter and kvcanary's dependencies load by themselves (site hooks, a
    # cuda-bindings release that uses importlib.resources) is not kvcanary's doing
    names = "('importlib.metadata', 'importlib.resources', 'concurrent.futures', 'email')"
    deps = "import sys, numpy, cuda.bindings.driver, cuda.bindings.nvrtc; "
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "KVCANARY_CACHE_DIR": str(tmp_path)}

    def loaded(code: str) -> set[str]:
        out = subprocess.run([sys.executable, "-c", f"{code} print([m for m in {names} if m in sys.modules])"],
                             capture_output=True, text=True, check=True, env=env)
        return set(ast.literal_eval(out.stdout.strip()))

    before = loaded(deps)
    for _ in range(2):  # the first import may compile (a thread pool); the second is warm
        added = loaded(deps + "import kvcanary;") - before
    assert added == set()


TINY = {"tiny.cu": 'extern "C" __global__ void kvc_tiny(int* p) { if (p) *p = 1; }\n'}


def _units(archs, names=("tiny",)):
    return [(a, n) for a in archs for n in names]


PROGRAMS = {"tiny": TINY, "small": {"small.cu": TINY["tiny.cu"].replace("kvc_tiny", "kvc_small")}}


def _here(arch, name):
    return nvrtc_program.compile_cubin(PROGRAMS[name], "", arch, program=nvrtc_program.program_name(name))


def test_units_compile_in_parallel_processes_to_the_same_cubins(monkeypatch, capsys):
    """Catches the first import's compile running one program at a time (NVRTC holds the GIL: a
    thread pool compiled six archs in 35 s on two cores): the units go to one worker process per
    CPU, each worker compiles several, and each yields the cubin this process would compile."""
    import subprocess
    started = []
    real_popen = subprocess.Popen
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: started.append(a[0]) or real_popen(*a, **k))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    got = {(a, n): c for a, n, c in kc_parallel.compile_units(_units([80, 90], PROGRAMS), PROGRAMS, "")}
    assert sorted(got) == sorted(_units([80, 90], PROGRAMS))
    assert len([cmd for cmd in started if "kvcanary.runtime.parallel_compile" in cmd]) == 2  # not one per unit
    for (arch, name), cubin in got.items():
        assert cubin == _here(arch, name)
    lines = capsys.readouterr().err.splitlines()  # one line per finished arch
    assert len(lines) == 2 and all(re.fullmatch(r"kvcanary: compiled sm_(80|90) \(\d+\.\d s\)", x) for x in lines)


def test_one_unit_compiles_here_without_a_worker(monkeypatch):
    import subprocess

    def no_worker(*a, **k):
        raise AssertionError("a worker started for one unit")
    monkeypatch.setattr(subprocess, "Popen", no_worker)
    assert list(kc_parallel.compile_units([(90, "tiny")], PROGRAMS, "")) == [(90, "tiny", _here(90, "tiny"))]


def test_a_worker_that_cannot_start_leaves_its_units_to_this_process(monkeypatch):
    import subprocess

    def no_interpreter(*a, **k):
        raise OSError("no interpreter")
    monkeypatch.setattr(subprocess, "Popen", no_interpreter)
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    got = list(kc_parallel.compile_units(_units([80, 86, 90]), PROGRAMS, ""))
    assert sorted((a, n) for a, n, _ in got) == _units([80, 86, 90]) and all(c for *_, c in got)


def test_a_worker_that_hangs_is_killed_and_its_unit_compiled_here(monkeypatch):
    """Never wait forever: a worker that delivers nothing in time is killed, and this process
    compiles its unit (an import must not hang on a stuck child)."""
    import subprocess
    import sys
    real_popen = subprocess.Popen
    hung = []

    def sleeper(cmd, *a, **k):  # a worker that never answers (nor reads its requests)
        proc = real_popen([sys.executable, "-c", "import time; time.sleep(60)"], *a, **k)
        hung.append(proc)
        return proc
    monkeypatch.setattr(subprocess, "Popen", sleeper)
    monkeypatch.setattr(kc_parallel, "WORKER_TIMEOUT_S", 0.5)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    got = {(a, n): c for a, n, c in kc_parallel.compile_units(_units([80, 90]), PROGRAMS, "")}
    assert sorted(got) == _units([80, 90]) and got[90, "tiny"] == _here(90, "tiny")
    for proc in hung:
        proc.wait(10)  # killed, not left behind
    assert len(hung) == 2 and all(p.returncode is not None for p in hung)


def test_a_failed_unit_raises_its_compile_error_here(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    broken = {"tiny": TINY, "bad": {"bad.cu": "extern \"C\" __global__ void kvc_bad() { nope; }\n"}}
    with pytest.raises(kc.CompileError, match=r"could not compile kvcanary_bad.cu for sm_90"):
        list(kc_parallel.compile_units(_units([90], broken), broken, ""))
