"""``python -m kvcanary doctor``: what is installed, what was compiled, which GPUs answer."""

from __future__ import annotations

import importlib.metadata as md
import sys

import numpy as np

import kvcanary

from .. import abi, errors
from ..runtime import devices, driver, memory, nvrtc_program


def _version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "not installed"


def run(out=sys.stdout) -> int:
    """Print the report; return 0 when everything needed works (a missing GPU is not an error)."""
    c = kvcanary.COMPILED
    say = lambda k, v: print(f"{k:<22} {v}", file=out)  # noqa: E731
    say("kvcanary", kvcanary.__version__)
    say("format", f"v{abi.FORMAT_VERSION} (SGLang KV canary compatible)")
    say("cuda-bindings", _version("cuda-bindings"))
    status = 0
    try:
        major, minor = nvrtc_program.nvrtc_version()
        say("NVRTC", f"{major}.{minor} ({c.nvrtc})")
    except Exception as exc:  # a broken install: libnvrtc missing; say so instead of a traceback
        say("NVRTC", f"error: {type(exc).__name__}: {str(exc).splitlines()[0]} (fix: pip install nvidia-cuda-nvrtc)")
        status = 1
    say("archs compiled", ", ".join(f"sm_{a}" for a in sorted(c.cubins)))
    for a in sorted(c.cubins):  # one cubin per kernel family (abi.FAMILIES)
        say(f"cubins sm_{a}", ", ".join(f"{f} {n / 1024:.0f} KB" for f, n in c.sizes(a).items()))
    if c.skipped_archs:
        say("archs skipped", ", ".join(f"sm_{a}" for a in c.skipped_archs))
    say("compile cache", f"{c.cache_dir or 'disabled (memory only)'}; import: {c.hits} hit(s), {c.misses} miss(es)")
    try:
        n = driver.device_count()
        say("driver", f"CUDA {driver.driver_version() // 1000}.{driver.driver_version() % 1000 // 10}")
        say("GPUs", n)
    except errors.NoCudaDriverError as exc:
        say("GPUs", f"none ({str(exc).split('(')[1].split(')')[0]})")
        say("backend", "CPU reference (numpy): host arrays run everywhere")
        return status
    except errors.KvCanaryError as exc:
        say("GPUs", f"error: {exc}")
        return 1
    for i in range(n):
        try:
            rt = devices.runtime(i)
            buf = memory.zeros(4, np.int64, i)
            p = abi.ProbeParams()
            p.out = buf.ptr
            rt.launch_struct("kvc_abi_layout", 1, 32, p, driver.PER_THREAD_STREAM)
            ok = int(buf.numpy()[0]) == abi.struct_size(abi.STRUCTS[0])
            say(f"GPU {i}", f"sm_{rt.capability[0]}{rt.capability[1]}, {rt.sm_count} SMs, cubin sm_{rt.arch}, "
                            f"launch round-trip {'ok' if ok else 'WRONG RESULT'}")
            status |= 0 if ok else 1
        except errors.KvCanaryError as exc:
            say(f"GPU {i}", f"error: {exc}")
            status = 1
    return status
