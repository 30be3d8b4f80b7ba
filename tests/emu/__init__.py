"""The kernels of kernels_src/ compiled for the CPU with the host C++ compiler and run by the CUDA
emulator of ``cuda_emu.h`` (tests only: a machine without a GPU runs the GPU tier's kernel checks
on the real kernel source). Needs g++ (C++17, ucontext); :func:`unavailable_reason` says why not.

The shared library is built once per source text into a cache folder; :class:`Kernels` launches
a kernel from the params struct bytes that ``cuLaunchKernel`` received.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from kvcanary import abi
from kvcanary.runtime.nvrtc_build import kernels_dir, read_sources

HERE = Path(__file__).resolve().parent
COMPILER = os.environ.get("CXX", "g++")
FLAGS = ("-std=c++17", "-O1", "-g0", "-fPIC", "-shared", "-w")
GLOBALS = tuple(v for f in abi.FAMILIES for v in f.variables)  # __device__ variables the host looks up
MAX_BLOCKS = 4                   # grid-stride kernels: any grid is correct; fewer blocks run faster


_PROBE = "#include <ucontext.h>\n#include <functional>\nstatic ucontext_t u;\nint main() { return getcontext(&u); }\n"


@functools.lru_cache(maxsize=None)
def unavailable_reason() -> str | None:
    """Why the emulator cannot be built here (no compiler, or one without C++17 and ucontext),
    or None. A failure to build the kernels themselves is an error, not a reason to skip."""
    if shutil.which(COMPILER) is None:
        return f"no host C++ compiler ({COMPILER}) to build the kernel emulator"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "probe.cpp"
        src.write_text(_PROBE)
        done = subprocess.run([COMPILER, "-std=c++17", str(src), "-o", str(Path(tmp) / "probe")],
                              capture_output=True, text=True, check=False)
    if done.returncode:
        return f"{COMPILER} cannot build a C++17 ucontext program: {done.stderr.strip()[-300:]}"
    return None


def _translation_unit() -> str:
    cu = [n for n in read_sources() if n.endswith(".cu")]
    lines = ['#include "cuda_emu.h"', '#include "kvcanary_abi.cuh"', *(f'#include "{n}"' for n in cu)]
    for kernel, struct in abi.KERNELS.items():
        lines.append(f'extern "C" void emu_{kernel}(const void* params, unsigned grid, unsigned grid_y, '
                     f'unsigned block) {{\n'
                     f'  {struct} p; std::memcpy(&p, params, sizeof p);\n'
                     f'  emu::launch(grid, grid_y, block, [&] {{ {kernel}(p); }});\n}}')
    for name in GLOBALS:
        lines.append(f'extern "C" void* emu_global_{name}(unsigned long long* size) '
                     f'{{ *size = sizeof {name}; return (void*)&{name}; }}')
    return "\n".join(lines) + "\n"


@functools.lru_cache(maxsize=None)
def library_path() -> Path:
    """Build (or find in the cache) the emulator library of the current kernel sources."""
    prelude, unit = abi.render_prelude(), _translation_unit()
    header = (HERE / "cuda_emu.h").read_text()
    h = hashlib.sha256()
    for part in (COMPILER, *FLAGS, header, prelude, unit, *(f"{k}\0{v}" for k, v in sorted(read_sources().items()))):
        h.update(part.encode() + b"\0")
    cache = Path(os.environ.get("KVCANARY_EMU_CACHE", Path(tempfile.gettempdir()) / "kvcanary-emu"))
    lib = cache / f"kernels-{h.hexdigest()[:24]}.so"
    if lib.exists():
        return lib
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        (Path(tmp) / "kvcanary_abi.cuh").write_text(prelude)
        (Path(tmp) / "emu_kernels.cpp").write_text(unit)
        out = Path(tmp) / lib.name
        cmd = [COMPILER, *FLAGS, f"-I{tmp}", f"-I{HERE}", f"-I{kernels_dir()}", str(Path(tmp) / "emu_kernels.cpp"),
               "-o", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode:
            raise RuntimeError(f"kv-canary: the host compiler rejected kernels_src/ for the CPU emulator "
                               f"(expected a clean build, as NVRTC's). Fix: make the kernel source portable "
                               f"C++ or extend tests/emu/cuda_emu.h.\n{' '.join(cmd)}\n{done.stderr[-4000:]}")
        os.replace(out, lib)  # atomic: a concurrent build finds a whole library or none
    return lib


class Kernels:
    """The emulated kernels of one library; launches are serialised (the emulator is one thread)."""

    def __init__(self):
        self.lib = ctypes.CDLL(str(library_path()))
        self.lock = threading.Lock()
        self.globals: dict[str, tuple[int, int]] = {}
        for name in GLOBALS:
            fn = getattr(self.lib, f"emu_global_{name}")
            fn.restype, fn.argtypes = ctypes.c_void_p, [ctypes.POINTER(ctypes.c_ulonglong)]
            size = ctypes.c_ulonglong()
            self.globals[name] = (fn(ctypes.byref(size)), size.value)

    def launch(self, kernel: str, grid: int, block: int, params: bytes, grid_y: int = 1) -> None:
        fn = getattr(self.lib, f"emu_{kernel}")
        fn.restype, fn.argtypes = None, [ctypes.c_char_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint]
        with self.lock:
            fn(params, min(int(grid), MAX_BLOCKS), int(grid_y), int(block))
