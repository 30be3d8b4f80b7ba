"""NVRTC compilation of the kernel families of kernels_src/ to cubins, one per family and arch.

Each family of ``abi.FAMILIES`` is its own NVRTC program (its .cu, the .cuh headers and the generated
prelude; compiled by :func:`kvcanary.runtime.nvrtc_program.compile_cubin`), compiled and cached per
arch on its own: an edit of verify.cu recompiles the verify family only. ``import kvcanary`` calls :func:`load_kernels`, which reads the cubins from the disk cache or
compiles them. NVRTC needs no driver and no GPU, so this runs on CPU-only machines (and in CI).
Cubins, not PTX: a driver older than NVRTC rejects its PTX but loads its cubins. Never calls cuInit.
Environment: ``KVCANARY_ARCHS`` (comma-separated, e.g. "80,90"; default :data:`DEFAULT_ARCHS`).
A cold compile (nothing in the cache) first prints one line on stderr saying so, then one per
finished arch (the programs compile in worker processes, :mod:`kvcanary.runtime.parallel_compile`: NVRTC holds the
GIL); a warm import prints nothing. Imports only the modules below it: the cubin cache, one program's
compile, and (on a cache miss only, being costly to import) the parallel compile.
"""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from .. import abi
from .._version import __version__
from . import nvrtc_program
from .cubin_cache import CubinCache, cache_key, default_dir
from ..errors import CompileError, ValidationError

# Every arch the kernels are built and tested for (the CPU tier compiles each). Import compiles
# DEFAULT_ARCHS: an sm_80 cubin runs on every 8.x GPU (sm_86, sm_89), sm_90 adds Hopper's
# programmatic dependent launch; a GPU of another major (sm_100, sm_120) gets its arch compiled,
# and cached, at its first launch. KVCANARY_ARCHS picks others (e.g. all of SUPPORTED_ARCHS).
SUPPORTED_ARCHS = (80, 86, 89, 90, 100, 120)
DEFAULT_ARCHS = (80, 90)


def kernels_dir() -> Path:
    """kernels_src/ shipped inside the wheel (kvcanary/kernels_src) or beside a source checkout."""
    package = Path(__file__).resolve().parent.parent  # kvcanary/
    packaged = package / "kernels_src"
    if packaged.is_dir():
        return packaged
    return package.parent / "kernels_src"


def read_sources(directory: Path | None = None) -> dict[str, str]:
    """Every .cu/.cuh file of kernels_src, by file name, in a stable order."""
    directory = directory or kernels_dir()
    files = sorted(p for p in directory.iterdir() if p.suffix in (".cu", ".cuh"))
    if not any(p.suffix == ".cu" for p in files):
        raise CompileError(f"kv-canary: no kernel sources (*.cu) found in {directory}; expected the "
                           f"kernels_src folder of the kvcanary package. Fix: reinstall kvcanary.")
    return {p.name: p.read_text() for p in files}


def family_sources(family: abi.KernelFamily, sources: dict[str, str]) -> dict[str, str]:
    """What the program of ``family`` reads: its .cu and every .cuh header of ``sources``."""
    if family.source not in sources:
        raise CompileError(f"kv-canary: kernel family {family.name} expects kernels_src/{family.source}, got only "
                           f"{sorted(n for n in sources if n.endswith('.cu'))}. Fix: reinstall kvcanary, or name "
                           f"the family's file in kvcanary/abi.py FAMILIES")
    return {n: s for n, s in sources.items() if n == family.source or n.endswith(".cuh")}


def configured_archs() -> tuple[int, ...]:
    raw = os.environ.get("KVCANARY_ARCHS", "").strip()
    if not raw:
        return DEFAULT_ARCHS
    try:
        archs = tuple(sorted({int(a.strip().removeprefix("sm_")) for a in raw.split(",") if a.strip()}))
    except ValueError:
        raise ValidationError(f"kv-canary: KVCANARY_ARCHS must be comma-separated compute "
                              f"capabilities like '80,90' or 'sm_90', got {raw!r}. Fix: set it to your "
                              f"GPUs' archs, e.g. KVCANARY_ARCHS=90 for an H100/H200, or unset it") from None
    if not archs:
        raise ValidationError(f"kv-canary: KVCANARY_ARCHS must name at least one compute capability, got "
                              f"{raw!r}. Fix: set it to e.g. KVCANARY_ARCHS=90, or unset it for the default archs")
    old = [a for a in archs if a < abi.MIN_ARCH]
    if old:
        raise ValidationError(f"kv-canary: KVCANARY_ARCHS names {', '.join(f'sm_{a}' for a in old)}, older than "
                              f"sm_{abi.MIN_ARCH}, the oldest arch kvcanary's kernels build for, got {raw!r}. Fix: "
                              f"set only sm_{abi.MIN_ARCH}+ archs (e.g. KVCANARY_ARCHS=90), or unset it; on an older "
                              f"GPU use the CPU reference backend (host arrays)")
    return archs


def installed_version(distribution: str) -> str | None:
    """Version of an installed distribution, read from the name of its ``.dist-info`` folder on
    sys.path (first match, as importlib.metadata finds it) without importing importlib.metadata,
    which costs more than the rest of a warm ``import kvcanary`` here."""
    prefix = distribution.replace("-", "_").lower() + "-"
    for entry in sys.path:
        try:
            with os.scandir(entry or ".") as names:
                for e in names:
                    name = e.name.lower()
                    if name.startswith(prefix) and name.endswith(".dist-info"):
                        return e.name[len(prefix):-len(".dist-info")]
        except OSError:  # a zip file or a missing folder on sys.path
            continue
    return None


def nvrtc_identity() -> str:
    """What names the NVRTC in use for the cache key, without loading libnvrtc when possible
    (loading it costs a few hundred ms): the nvidia-cuda-nvrtc wheel's exact version, else the
    library's own major.minor."""
    version = installed_version("nvidia-cuda-nvrtc")
    if version is not None:
        return "wheel " + version
    major, minor = nvrtc_program.nvrtc_version()
    return f"lib {major}.{minor}"


def compile_family(family: abi.KernelFamily, sources: dict[str, str], prelude: str, arch: int) -> bytes:
    """The cubin of one family's program for sm_<arch>."""
    return nvrtc_program.compile_cubin(family_sources(family, sources), prelude, arch,
                                       program=nvrtc_program.program_name(family.name))


def family_key(family: abi.KernelFamily, arch: int, sources: dict[str, str], prelude: str, identity: str) -> str:
    """The cache key of a family's cubin for sm_<arch>: every input of its program, nothing else."""
    return cache_key(schema="kvcanary-kernels/2", kvcanary=__version__, nvrtc=identity, arch=arch, family=family.name,
                     options=tuple(sorted(nvrtc_program.OPTIONS)), prelude=prelude.encode(),
                     sources=tuple((n, s.encode()) for n, s in family_sources(family, sources).items()))


@dataclass(repr=False)
class CompiledKernels:
    """Cubins by arch, then by family name, plus what the doctor reports about how they were
    obtained. Its repr names the archs, families and sizes, never the cubin bytes (megabytes)."""

    cubins: dict[int, dict[str, bytes]]
    nvrtc: str  # nvrtc_identity(): what the cache keys name
    cache_dir: Path | None
    hits: int
    misses: int
    skipped_archs: tuple[int, ...] = ()
    keys: dict[tuple[int, str], str] = field(default_factory=dict)  # (arch, family) -> cache key

    def sizes(self, arch: int) -> dict[str, int]:
        """Bytes of each family's cubin for ``arch``."""
        return {f: len(c) for f, c in self.cubins.get(arch, {}).items()}

    def __repr__(self) -> str:
        sizes = ", ".join(f"sm_{a}: {len(c)} families, {sum(self.sizes(a).values()) / 1e6:.2f} MB"
                          for a, c in sorted(self.cubins.items()))
        return (f"CompiledKernels(cubins={{{sizes}}}, nvrtc={self.nvrtc!r}, cache_dir="
                f"{str(self.cache_dir) if self.cache_dir else None!r}, hits={self.hits}, misses={self.misses}, "
                f"skipped_archs={self.skipped_archs}, keys={len(self.keys)})")


def compile_notice(archs, cache_dir: Path | None, families=None) -> str:
    """The one stderr line printed before a cold compile: what runs, why, and how to avoid it."""
    where = (f"cached in {cache_dir} for the next import" if cache_dir is not None
             else "not cached: KVCANARY_CACHE=0 compiles at every import")
    which = f" ({', '.join(sorted(families))})" if families else ""
    return (f"kvcanary: compiling the CUDA kernels{which} with NVRTC for {', '.join(f'sm_{a}' for a in archs)} "
            f"(about 6 s of CPU per arch, one process per CPU; {where}). To compile fewer, set KVCANARY_ARCHS to "
            f"your GPUs' archs, e.g. KVCANARY_ARCHS=90; KVCANARY_CACHE_DIR picks the cache directory.")


def pick_cubin(cubins: dict[int, dict[str, bytes]], capability: tuple[int, int]) -> int | None:
    """Highest compiled arch (a key of ``cubins``) a device can run: same major, minor not above the device's."""
    major, minor = capability
    fits = [a for a in cubins if a // 10 == major and a % 10 <= minor]
    return max(fits) if fits else None


def load_kernels(archs: tuple[int, ...] | None = None, cache: CubinCache | None = None,
                 families: tuple[abi.KernelFamily, ...] | None = None) -> CompiledKernels:
    """Cubins of every family (or of ``families``) for every arch, from the cache when possible,
    compiled (in parallel) otherwise. The configured archs' set (no arguments, the default cache) is
    kept: :func:`loaded` returns it."""
    global _LOADED
    default = archs is None and cache is None and families is None
    archs, families = archs or configured_archs(), families or abi.FAMILIES
    cache = cache if cache is not None else CubinCache(default_dir())
    identity = nvrtc_identity()
    sources, prelude = read_sources(), abi.render_prelude()
    keys = {(a, f.name): family_key(f, a, sources, prelude, identity) for a in archs for f in families}
    hits0, misses0 = cache.hits, cache.misses
    cubins: dict[int, dict[str, bytes]] = {a: {} for a in archs}
    todo = []
    for (a, name), key in keys.items():
        if (cubin := cache.get(key)) is not None:
            cubins[a][name] = cubin
        else:
            todo.append((a, name))
    skipped: tuple[int, ...] = ()
    if todo:  # only now is libnvrtc loaded
        available = set(nvrtc_program.supported_archs())
        skipped = tuple(sorted({a for a, _ in todo if a not in available}))
        if skipped:
            warnings.warn(f"kv-canary: NVRTC {identity} cannot target {', '.join(f'sm_{a}' for a in skipped)}; skipping them "
                          f"(supported: {sorted(available)}). Fix: set KVCANARY_ARCHS to supported "
                          f"archs or upgrade nvidia-cuda-nvrtc.", RuntimeWarning, stacklevel=2)
        todo = [(a, name) for a, name in todo if a in available]
        if todo:
            names = {name for _, name in todo}  # named when not every family compiles (an edit of one .cu)
            print(compile_notice(sorted({a for a, _ in todo}), cache.directory,
                                 names if len(names) < len(abi.FAMILIES) else None), file=sys.stderr, flush=True)
        from .parallel_compile import compile_units  # only on a cache miss: it imports subprocess and queue
        programs = {f.name: family_sources(f, sources) for f in families}
        for a, name, cubin in compile_units(todo, programs, prelude):
            cache.put(keys[a, name], cubin)
            cubins[a][name] = cubin
    ordered = {a: {f.name: c[f.name] for f in families if f.name in c} for a, c in cubins.items() if a not in skipped}
    compiled = CompiledKernels(cubins=ordered, nvrtc=identity,
                               cache_dir=cache.directory, hits=cache.hits - hits0, misses=cache.misses - misses0,
                               skipped_archs=skipped, keys=keys)
    if default:
        _LOADED = compiled
    return compiled


_LOADED: CompiledKernels | None = None


def loaded() -> CompiledKernels | None:
    """The configured archs' kernels as the last default :func:`load_kernels` (``import kvcanary``)
    left them, or None."""
    return _LOADED
