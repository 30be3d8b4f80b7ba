"""Which CUDA stream a launch goes on (docs/format.md §9).

An explicit stream always wins: an int handle, a torch/CuPy stream object (``cuda_stream`` /
``ptr``), or anything with ``__cuda_stream__``. Otherwise the current stream of the framework that
owns the arrays (torch's raw current stream without the public call's overhead, CuPy's current
stream), then a stream a ``__cuda_array_interface__`` v3 producer named, and finally the per-thread
default stream. The legacy stream 0 is never chosen implicitly: work there escapes CUDA-graph
capture silently. Frameworks are looked up in ``sys.modules``, never imported.

A launch goes to the device that owns its arrays: :func:`resolve` refuses a launch whose arrays
do not all live on the device it was asked for (every launch path of kvcanary.ops calls it).
Pure host logic: of the runtime it uses only the driver's stream constants, and calls no driver.
"""

from __future__ import annotations

import sys
from typing import Any, Iterable

import numpy as np

from ..errors import ValidationError, ValidationTypeError
from ..interop.arrays import ArrayView
from .driver import PER_THREAD_STREAM


def stream_handle(stream: Any) -> int:
    """The raw CUstream handle of an explicit stream argument."""
    if isinstance(stream, (bool, np.bool_)):  # True would be handle 1: the legacy stream
        raise ValidationTypeError(f"kv-canary: stream must be an int CUstream handle or a torch/CuPy stream "
                                  f"object, got the bool {stream!r}. Fix: pass e.g. torch.cuda.current_stream(), "
                                  f"a CuPy stream, or None (the current stream)")
    if isinstance(stream, (int, np.integer)):
        if not 0 <= int(stream) < 1 << 64:
            raise ValidationError(f"kv-canary: stream handle must be a CUstream value in [0, 2**64), got "
                                  f"{int(stream)}. Fix: pass the stream object (e.g. torch.cuda.current_stream()) "
                                  f"or its .cuda_stream")
        return int(stream)
    if hasattr(stream, "__cuda_stream__"):
        return int(stream.__cuda_stream__()[1])
    for attr in ("cuda_stream", "ptr", "handle"):
        if hasattr(stream, attr):
            return int(getattr(stream, attr))
    raise ValidationTypeError(f"kv-canary: stream must be an int CUstream handle or a torch/CuPy "
                              f"stream object, got {type(stream).__name__}. Fix: pass e.g. "
                              f"torch.cuda.current_stream(), a CuPy stream, or None (the current stream)")


def framework_stream(objs: Iterable[Any], device: int) -> int | None:
    """The current stream of the framework owning the first of ``objs`` it knows, else None."""
    for obj in objs:
        module = type(obj).__module__.split(".")[0]
        if module == "torch" and "torch" in sys.modules:
            return int(sys.modules["torch"]._C._cuda_getCurrentRawStream(device))
        if module == "cupy" and "cupy" in sys.modules:
            cupy = sys.modules["cupy"]
            with cupy.cuda.Device(device):
                return int(cupy.cuda.get_current_stream().ptr)
    return None


def on_device(views: Iterable[ArrayView | None], device: int) -> None:
    """Raise unless every view (None entries skipped) lives on CUDA device ``device``."""
    for v in views:
        if v is not None and v.device != device:
            where = "host memory" if v.device is None else f"cuda:{v.device}"
            raise ValidationError(
                f"kv-canary: every array of one launch must live on the launch's device, expected "
                f"cuda:{device} (the canary state's device), got an array on {where} ({v.describe()}). "
                f"Fix: allocate it on cuda:{device}, e.g. t.to('cuda:{device}'), or build the canary "
                f"state on the device of the arrays")


def resolve(stream: Any, objs: Iterable[Any], views: Iterable[ArrayView | None], device: int) -> int:
    """The stream handle for a launch on ``device`` over the user arrays ``objs`` whose views are
    ``views`` (each must live on ``device``: ValidationError otherwise, see :func:`on_device`)."""
    views = tuple(views)
    on_device(views, device)
    if stream is not None:
        return stream_handle(stream)
    found = framework_stream(objs, device)
    if found is not None:
        return found
    for v in views:
        if v is not None and v.stream is not None:
            return int(v.stream)
    return PER_THREAD_STREAM
