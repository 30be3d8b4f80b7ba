"""One NVRTC program compiled to one cubin, and what NVRTC itself answers (its version, its archs).

The bottom of the compile side of kvcanary.runtime: it knows nothing of kernel families, the cache
or parallel workers, so :mod:`~kvcanary.runtime.nvrtc_build` (the families, their cache) and the
workers of :mod:`~kvcanary.runtime.parallel_compile` both compile through :func:`compile_cubin`.
``cuda.bindings.nvrtc`` is imported on first use; nothing here touches the CUDA driver.
"""

from __future__ import annotations

import re

from ..errors import CompileError

OPTIONS = ("-std=c++17", "--device-as-default-execution-space", "-lineinfo")
PRELUDE_NAME = "kvcanary_abi.cuh"  # the generated ABI prelude's header name (abi.render_prelude)
# Set in the environment of a parallel_compile worker: the worker's ``import kvcanary`` then
# compiles nothing (it only answers the programs it is sent). Here, not in parallel_compile, so that
# ``import kvcanary`` can read it without importing the worker machinery (subprocess, queue).
WORKER_ENV = "KVCANARY_COMPILE_WORKER"


def _nvrtc():
    """cuda.bindings.nvrtc, imported on first use: a warm ``import kvcanary`` loads the cubins from
    the cache and never needs it (importing it takes about 0.1 s)."""
    from cuda.bindings import nvrtc
    return nvrtc


def nvrtc_version() -> tuple[int, int]:
    nvrtc = _nvrtc()
    _, major, minor = nvrtc.nvrtcVersion()
    return int(major), int(minor)


def supported_archs() -> tuple[int, ...]:
    nvrtc = _nvrtc()
    _, archs = nvrtc.nvrtcGetSupportedArchs()
    return tuple(int(a) for a in archs)


def _check(result, what: str) -> None:
    nvrtc = _nvrtc()
    if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise CompileError(f"kv-canary: {what} failed with {result.name}")


def _out_buffer(size: int) -> bytes:
    """A fresh bytes object NVRTC may write into. Never a 0- or 1-byte one: CPython shares those
    as singletons, and writing into one corrupts every b" " (and str " ") in the process."""
    return bytes(max(int(size), 2))


def compile_cubin(sources: dict[str, str], prelude: str, arch: int,
                  options: tuple[str, ...] = OPTIONS, program: str = "kvcanary_kernels.cu") -> bytes:
    """Compile every .cu of ``sources`` as one NVRTC program for sm_<arch>; return the cubin."""
    nvrtc = _nvrtc()
    main = "".join(f'#include "{name}"\n' for name in sources if name.endswith(".cu"))
    headers = {PRELUDE_NAME: prelude, **sources}
    err, prog = nvrtc.nvrtcCreateProgram(main.encode(), program.encode(), len(headers),
                                         [v.encode() for v in headers.values()],
                                         [k.encode() for k in headers])
    _check(err, "nvrtcCreateProgram")
    opts = (*options, f"--gpu-architecture=sm_{arch}")
    try:
        (result,) = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        err, size = nvrtc.nvrtcGetProgramLogSize(prog)
        log = _out_buffer(size)
        nvrtc.nvrtcGetProgramLog(prog, log)
        log_text = log.rstrip(b"\0 ").decode(errors="replace")
        if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            named = [n for n in headers if re.search(rf"\b{re.escape(n)}\(\d+\)", log_text)]
            shown = "\n".join(f"// ===== {n}\n{headers[n]}" for n in (named or list(sources)))
            raise CompileError(f"kv-canary: NVRTC could not compile {program} for sm_{arch} "
                               f"({result.name}); expected a clean compile of kernels_src. Fix: "
                               f"correct the source named in the log below.",
                               log=log_text, options=opts, source=shown)
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        _check(err, "nvrtcGetCUBINSize")
        cubin = _out_buffer(size)
        _check(nvrtc.nvrtcGetCUBIN(prog, cubin)[0], "nvrtcGetCUBIN")
        return cubin[:size]
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def program_name(family: str) -> str:
    """The NVRTC program name of a family (its cubin's line info names it)."""
    return f"kvcanary_{family}.cu"
