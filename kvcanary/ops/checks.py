"""The checks every state array passes (metadata only: no element is read), and zeroed state
arrays on the host or a device. One place for them: the state objects, the plans, the binding
and the backends all check their arrays here."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..errors import ValidationError, ValidationTypeError
from ..interop.arrays import ArrayView, as_view
from ..runtime import memory
from ..validate import device as check_device
from .sources import resolved


def alloc_zeros(shape, dtype, device: int | None):
    """Zeroed numpy array (device None) or kvcanary DeviceArray on ``device``."""
    device = check_device("device", device)
    if device is None:
        try:
            return np.zeros(shape, dtype)
        except MemoryError:
            nbytes = int(np.prod(shape, dtype=object)) * np.dtype(dtype).itemsize
            raise ValidationError(f"kv-canary: host memory for a {tuple(shape)} {np.dtype(dtype).name} array must be "
                                  f"available, got none for its {nbytes} bytes (numpy could not allocate them). "
                                  f"Fix: ask for fewer slots or rows") from None
    return memory.zeros(shape, dtype, device)


def _shape_text(shape) -> str:
    return "(" + ", ".join("*" if s is None else str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"


def checked(array, name: str, *, dtype, shape=None, ndim=None, writable=False) -> ArrayView:
    """as_view plus the dtype / shape / contiguity / writability rules every state array obeys
    (metadata only: no element is read)."""
    v = resolved(as_view(array, name=name))
    want = np.dtype(dtype).name
    if v.dtype != np.dtype(dtype):
        order = "" if v.dtype.isnative else f" in non-native byte order ({v.dtype.str})"
        raise ValidationTypeError(f"kv-canary: {name} must have dtype {want}, got {v.dtype_name}{order}. Fix: "
                                  f"allocate it as {want} (e.g. a.astype(np.{want}) or t.to(torch.{want}))")
    if ndim is not None and len(v.shape) != ndim:
        raise ValidationError(f"kv-canary: {name} must be {ndim}-D, got shape {v.shape}. Fix: pass a "
                              f"{ndim}-D array" + (f" of shape {_shape_text(shape)}" if shape else ""))
    if shape is not None:
        for want_n, got_n in zip(shape, v.shape):
            if want_n is not None and want_n != got_n:
                raise ValidationError(f"kv-canary: {name} must have shape {_shape_text(shape)}, got {v.shape}. "
                                      f"Fix: allocate it with shape {_shape_text(shape)}")
    if not v.is_c_contiguous():
        raise ValidationError(f"kv-canary: {name} must be C-contiguous, got strides {v.strides} for "
                              f"shape {v.shape}. Fix: .contiguous() / np.ascontiguousarray (and pass that copy)")
    if writable and v.readonly:
        raise ValidationError(f"kv-canary: {name} must be writable, got a read-only array. Fix: pass the "
                              f"writable buffer itself, not a read-only view")
    return v


def same_device(views: Sequence[ArrayView | None], what: str) -> int | None:
    devices = {v.device for v in views if v is not None}
    if len(devices) > 1:
        where = ", ".join("host" if d is None else f"cuda:{d}" for d in sorted(devices, key=lambda d: -1 if d is None else d))
        raise ValidationError(f"kv-canary: all arrays of {what} must live on one device, got {where}; "
                              f"fix: move them to the canary buffer's device")
    return next(iter(devices)) if devices else None
