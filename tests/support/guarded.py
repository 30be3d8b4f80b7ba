"""Guard-page memory and forked runs for the kernel fuzz suite (tests only).

:class:`Arena` places every array in a mapping of its own, ``[PROT_NONE page][data pages]
[PROT_NONE page]``, either with the array's end touching the upper guard (``"end"``: an overrun
faults) or its start right after the lower guard (``"start"``: an underrun, e.g. row -1, faults).
The array gets a kvcanary "device" view on ordinal 0 (the fake driver's device memory is host
memory, so the emulated kernels address it directly) and a numpy view of the same bytes.

What a placement cannot catch: in ``"end"`` placement an array is aligned down to its alignment
(its itemsize; 16 bytes for real-KV sources and the canary buffer, which 16-byte loads read), so
when its size is not a multiple of that alignment the last ``size % align`` bytes before the
guard are padding and an overrun smaller than that lands in the padding unseen; an underrun is
caught only in ``"start"`` placement and an overrun only in ``"end"`` placement (the other side of
the data pages is ordinary mapped memory). A wild access far past either guard lands wherever it
lands. Only pages the arena maps are guarded; memory the library allocates itself (the packed
source descriptors) is ordinary.

:func:`run_forked` runs a function in a forked child so that a fault fails the test instead of
killing pytest; the child reports the kernel it was running when it died.
"""

from __future__ import annotations

import ctypes
import faulthandler
import mmap
import os
import signal
import traceback

import numpy as np

from kvcanary.interop.arrays import from_pointer

PAGE = mmap.PAGESIZE
PROT_NONE = 0  # <sys/mman.h> (the mmap module exports only PROT_READ, PROT_WRITE, PROT_EXEC)
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
PLACEMENTS = ("end", "start")


class Arena:
    """Guarded arrays of one placement; :meth:`close` unmaps them (a forked child may just exit)."""

    def __init__(self, placement: str):
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
        self.placement = placement
        self.maps: list[tuple[int, int]] = []

    def _place(self, nbytes: int, align: int) -> int:
        data_pages = max(1, -(-nbytes // PAGE))
        size = (data_pages + 2) * PAGE
        base = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        if base in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), "mmap failed")
        self.maps.append((base, size))
        upper = base + (data_pages + 1) * PAGE
        for guard in (base, upper):
            if _libc.mprotect(guard, PAGE, PROT_NONE):
                raise OSError(ctypes.get_errno(), "mprotect failed")
        if self.placement == "start":
            return base + PAGE
        return (upper - nbytes) // align * align  # aligned down: size % align bytes of padding before the guard

    def put(self, host: np.ndarray, *, align: int | None = None):
        """A guarded copy of the C-contiguous ``host``: (kvcanary device view, numpy view)."""
        host = np.ascontiguousarray(host)
        ptr = self._place(host.nbytes, align or host.itemsize)
        ctypes.memmove(ptr, host.ctypes.data, host.nbytes)
        return from_pointer(ptr, host.shape, host.dtype, device=0), _numpy_at(ptr, host.shape, host.dtype, host.strides)

    def put_rows(self, host: np.ndarray, pitch: int, *, align: int = 16):
        """A uint8 ``[rows, width]`` array whose rows lie ``pitch`` bytes apart (a column slice of
        a wider buffer); the last row's last byte touches the guard in ``"end"`` placement."""
        rows, width = host.shape
        span = (rows - 1) * pitch + width if rows else 0
        ptr = self._place(span, align)
        view = _numpy_at(ptr, host.shape, np.uint8, (pitch, 1))
        view[...] = host
        return from_pointer(ptr, host.shape, np.uint8, device=0, strides=(pitch, 1)), view

    def close(self) -> None:
        for base, size in self.maps:
            _libc.munmap(base, size)
        self.maps.clear()


def _numpy_at(ptr: int, shape, dtype, strides) -> np.ndarray:
    dtype = np.dtype(dtype)
    if 0 in shape:
        return np.zeros(shape, dtype)
    span = sum((n - 1) * s for n, s in zip(shape, strides)) + dtype.itemsize
    raw = (ctypes.c_char * span).from_address(ptr)
    return np.ndarray(shape, dtype, buffer=raw, strides=strides)


class _Marker:
    """Where a forked child reports which kernel it is running (one line per launch)."""

    fd: int | None = None

    @classmethod
    def note(cls, text: str) -> None:
        if cls.fd is not None:
            os.write(cls.fd, f"{text}\n".encode())


note = _Marker.note


def run_forked(fn, *, timeout_s: int = 60) -> None:
    """Run ``fn()`` in a forked child; raise AssertionError in the parent if it failed.

    A child killed by SIGSEGV or SIGBUS is reported as an out-of-bounds access in the kernel it
    was running (the last :func:`note`), SIGALRM as a hang; an exception in the child is reported
    with its traceback. The child never returns into pytest (``os._exit``)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: notes, then a NUL and the traceback if fn raised
        os.close(r)
        faulthandler.disable()  # the parent reports the fault; no dump of pytest's stack
        _Marker.fd = w
        code = 0
        try:
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(timeout_s)
            fn()
        except BaseException:  # noqa: BLE001 - everything goes back to the parent
            os.write(w, ("\0" + traceback.format_exc()).encode())
            code = 1
        os._exit(code)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 1 << 16):
        chunks.append(chunk)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    notes, _, error = b"".join(chunks).decode(errors="replace").partition("\0")
    launches = notes.split()
    where = launches[-1] if launches else "the host code before any launch"
    if os.WIFSIGNALED(status):
        sig = signal.Signals(os.WTERMSIG(status))
        if sig in (signal.SIGSEGV, signal.SIGBUS):
            raise AssertionError(f"out-of-bounds access in {where} ({sig.name}); launches: {launches}")
        if sig == signal.SIGALRM:
            raise AssertionError(f"no result after {timeout_s} s in {where} (a hang?); launches: {launches}")
        raise AssertionError(f"child killed by {sig.name} in {where}; launches: {launches}")
    if os.WEXITSTATUS(status) != 0:
        raise AssertionError(f"after launches {launches}:\n{error or 'exit status %d' % os.WEXITSTATUS(status)}")
